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


def layer_sliding_windows(config: Any, num_layers: int) -> list[int | None]:
    """Each layer's attention window as HF's attention applies it (None: the whole context).

    Reads ``layer_types`` where the config has it (transformers 4.53+: Qwen2, Gemma 2/3);
    otherwise a set ``sliding_window`` applies to every layer (Mistral, Phi-3), unless
    ``use_sliding_window`` says it is off, and Qwen2's first ``max_window_layers`` are global.
    """
    window = getattr(config, "sliding_window", None)
    if not window or int(window) < 1:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [int(window) if t == SLIDING else None for t in layer_types[:num_layers]]
    if not getattr(config, "use_sliding_window", True):
        return [None] * num_layers
    first = int(getattr(config, "max_window_layers", 0) or 0) if hasattr(config, "use_sliding_window") else 0
    return [int(window) if i >= first else None for i in range(num_layers)]


def kv_sliding_window(config: Any) -> int | None:
    """Every layer's sliding window when all layers slide (the largest), else None: free nothing."""
    num_layers = int(config.num_hidden_layers)
    windows = layer_sliding_windows(config, num_layers)
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
