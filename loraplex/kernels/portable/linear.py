"""``LinearBackend`` on ``F.linear``: cuBLAS on CUDA, MKL / oneDNN on the CPU.

Packed weights are dequantized on every call: the reference the quantized kernels are
tested against, and the path of last resort (it costs the float matrix each time)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.contracts import LinearBackend, PackedWeight, Weight


def reference_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: PackedWeight,
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features] in x's dtype
    """``x @ dequantize(W)^T + bias`` in float32, the result in ``x``'s dtype."""
    w = weight.dequantize().to(x.device)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


class PortableLinearBackend(LinearBackend):
    """``y = x @ W^T + b`` through ``F.linear``, on the weight as loaded."""

    name = "torch"

    def __call__(
        self,
        x: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        if isinstance(weight, PackedWeight):
            return reference_linear(x, weight, bias)
        return F.linear(x, weight, bias)
