"""``PointwiseBackend`` in plain PyTorch: HF transformers' float32 arithmetic, op by op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.contracts import PointwiseBackend


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PortablePointwiseBackend(PointwiseBackend):
    """The reference: every dtype and device."""

    name = "torch"

    def add_rms_norm(
        self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            residual = residual + delta
        return rms_norm(residual, weight, eps), residual

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        heads = x.view(x.shape[0], -1, weight.shape[0])
        heads.copy_(rms_norm(heads, weight, eps))

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        num_tokens = qk.shape[0]
        heads = qk.view(num_tokens, -1, head_dim)
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)
        heads.copy_(heads * cos_h + rotate_half(heads) * sin_h)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
