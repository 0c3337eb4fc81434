"""``LinearBackend`` on ``F.linear``: cuBLAS on CUDA, MKL / oneDNN on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.contracts import LinearBackend


class PortableLinearBackend(LinearBackend):
    """``y = x @ W^T + b`` through ``F.linear``, on the weight as loaded."""

    name = "torch"

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)
