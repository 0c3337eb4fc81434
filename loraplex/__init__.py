"""loraplex: multi-tenant LoRA serving on a paged KV cache.

The offline API mirrors vLLM's::

    from loraplex import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from loraplex.adapters.request import LoRARequest
    from loraplex.platform.engine.beam_search import BeamSearchParams
    from loraplex.platform.engine.config import EngineConfig
    from loraplex.platform.engine.outputs import RequestOutput
    from loraplex.platform.engine.sampling_params import SamplingParams
    from loraplex.platform.llm import LLM

_LAZY = {
    "LLM": "loraplex.platform.llm",
    "EngineConfig": "loraplex.platform.engine.config",
    "SamplingParams": "loraplex.platform.engine.sampling_params",
    "RequestOutput": "loraplex.platform.engine.outputs",
    "LoRARequest": "loraplex.adapters.request",
    "BeamSearchParams": "loraplex.platform.engine.beam_search",
}


def __getattr__(name: str) -> Any:
    # Lazy so `import loraplex` stays cheap (no torch import until needed).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
