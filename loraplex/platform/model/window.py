"""Which sliding window the KV block manager may free by, read from a HF config.

The block manager keeps one block table per sequence for all layers, so it may free a
block only when *every* layer's window has left it behind. That holds when every layer
slides (Mistral; Qwen2 with ``use_sliding_window`` on all layers; a Gemma 3 too short to
reach a global layer), and then the window is the largest layer window. One global layer
(Gemma 2's alternation, Gemma 3's 5:1, Qwen2's first ``max_window_layers``) needs the
whole context: nothing is freed (``None``). vLLM frees per layer group instead (one table
per group); that is the step beyond this one.
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"


def kv_sliding_window(config: Any) -> int | None:
    """Every layer's sliding window when all layers slide, else None (free nothing).

    Reads ``layer_types`` where the config has it (transformers 4.53+: Qwen2, Gemma 2/3);
    otherwise a set ``sliding_window`` applies to every layer (Mistral, Phi-3), unless
    ``use_sliding_window`` says it is off (Qwen2's older configs).
    """
    window = getattr(config, "sliding_window", None)
    if not window or int(window) < 1:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types and all(t == SLIDING for t in layer_types) else None
    if not getattr(config, "use_sliding_window", True):
        return None
    if getattr(config, "max_window_layers", 0):
        return None  # Qwen2 without layer_types: the first max_window_layers layers are global
    return int(window)
