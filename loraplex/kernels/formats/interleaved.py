"""Q8_0 / Q4_0 / Q4_1 blocks with 16 weight rows interleaved: the CPU kernels' layout for
integer dot products (``cpu/quant_x16.c``), made from the GGUF rows at load time.

The same blocks, the same bytes (a weight keeps the file's size), rearranged so that one
64-byte vector holds 4 bytes of each of 16 rows (one row per 32-bit lane). For each group of
16 rows (rows ``16 g .. 16 g + 15``; ``out_features`` a multiple of 16), block ``b``:

| format | bytes | layout |
|---|---|---|
| ``q8_0x16`` | 544 | ``d[16]`` f16, then 8 chunks of [16 rows x 4 bytes of q + 128] |
| ``q4_0x16`` | 288 | ``d[16]`` f16, then 4 chunks of [16 rows x 4 bytes of qs] |
| ``q4_1x16`` | 320 | ``d[16]``, ``m[16]`` f16, then 4 chunks of [16 rows x 4 bytes of qs] |

Q8_0's q is stored + 128 (unsigned), so every weight byte is an unsigned operand of the dot
product instructions. ``data`` is still [out_features, row_bytes] uint8, but byte row i is
not weight row i: the group's 16 byte rows hold its 16 weight rows together (``rows`` reads
through the groups).

Each format exists twice, by the activations the kernels quantize to at few rows (decode
steps): ``*x16`` int16 per 32-block (error ~1e-5 of the block's largest value: the float
path's greedy tokens) and ``*x16a8`` int8 per 32-block (llama.cpp's Q8 activations: fewer
instructions, but greedy tokens drift from HF's at ordinary gaps). Many rows (prefill) decode
the blocks to floats exactly, in both.
"""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import WeightFormat, WeightFormatName

GROUP = 16  # weight rows per interleaved group


def quantize_activations(x: torch.Tensor, bits: int) -> torch.Tensor:  # x's shape, float32
    """The floats the integer kernels compute with for ``x`` ([rows, k], k a multiple of 32):
    per 32-block ``q = round(x / d)`` (half to even), ``d = amax / (2^(bits-1) - 1)``, as
    ``dq * q`` (the torch reference of ``quant_x16_quantize.c``'s activation quantization)."""
    blocks = x.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / float(2 ** (bits - 1) - 1)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return (torch.round(blocks * inv) * d).reshape(x.shape)


class Interleaved(WeightFormat):
    """``base``'s blocks, 16 rows interleaved (see the module docstring)."""

    block_size = 32

    def __init__(self, base: WeightFormat, name: WeightFormatName, c_id: int, int8_activations: bool) -> None:
        assert base.name in ("q8_0", "q4_0", "q4_1"), base.name
        self.base = base
        self.name = name
        self.block_bytes = base.block_bytes
        self.c_id = c_id
        self.int8_activations = int8_activations
        self._head = 4 if base.name == "q4_1" else 2  # scale bytes per row per block (d, or d and m)

    @property
    def activation_bits(self) -> int:
        """Bits of the activations at few rows (``quantize_activations``)."""
        return 8 if self.int8_activations else 16

    def check_rows(self, out_features: int) -> None:
        if out_features % GROUP:
            raise ValueError(f"{self.name} interleaves {GROUP} rows; {out_features} is not a multiple")

    def interleave(self, data: torch.Tensor, in_features: int) -> torch.Tensor:  # [rows, row_bytes] uint8
        """GGUF rows of ``base`` ([rows, row_bytes] uint8) in this layout."""
        rows = data.shape[0]
        self.check_rows(rows)
        nb, bb, head = in_features // 32, self.block_bytes, self._head
        blocks = data.reshape(rows // GROUP, GROUP, nb, bb).permute(0, 2, 1, 3)  # [g, b, row, byte]
        scales = [
            blocks[..., off : off + 2].reshape(rows // GROUP, nb, 2 * GROUP) for off in range(0, head, 2)
        ]
        qs = blocks[..., head:]  # [g, b, row, q bytes]
        if self.base.name == "q8_0":
            qs = qs ^ 0x80  # int8 q -> q + 128
        chunks = qs.reshape(rows // GROUP, nb, GROUP, -1, 4).permute(0, 1, 3, 2, 4)  # [g, b, chunk, row, 4]
        out = torch.cat([*scales, chunks.reshape(rows // GROUP, nb, -1)], dim=2)
        return out.reshape(rows, -1).contiguous()

    def deinterleave(self, data: torch.Tensor, in_features: int) -> torch.Tensor:  # [rows, row_bytes] uint8
        """The GGUF rows back (the inverse of ``interleave``)."""
        rows = data.shape[0]
        self.check_rows(rows)
        nb, bb, head = in_features // 32, self.block_bytes, self._head
        groups = data.reshape(rows // GROUP, nb, GROUP * bb)
        parts = [
            groups[..., GROUP * off : GROUP * (off + 2)].reshape(rows // GROUP, nb, GROUP, 2)
            for off in range(0, head, 2)
        ]
        qs = groups[..., GROUP * head :].reshape(rows // GROUP, nb, -1, GROUP, 4).permute(0, 1, 3, 2, 4)
        qs = qs.reshape(rows // GROUP, nb, GROUP, -1)
        if self.base.name == "q8_0":
            qs = qs ^ 0x80
        blocks = torch.cat([*parts, qs], dim=3)  # [g, b, row, block bytes]
        return blocks.permute(0, 2, 1, 3).reshape(rows, -1).contiguous()

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        return self.base.dequantize(self.deinterleave(data, in_features), in_features)

    def rows(self, data: torch.Tensor, index: torch.Tensor, in_features: int) -> torch.Tensor:
        # Only the asked rows' bytes: their lane of each block's scales and chunks, as GGUF blocks.
        index = index.long()
        nb, head = in_features // 32, self._head
        groups = data.reshape(-1, nb, GROUP * self.block_bytes).index_select(
            0, index // GROUP
        )  # [len, nb, .]
        lane = (index % GROUP).view(-1, 1, 1, 1).expand(-1, nb, 1, 2)
        parts = [
            groups[..., GROUP * off : GROUP * (off + 2)].reshape(len(index), nb, GROUP, 2).gather(2, lane)
            for off in range(0, head, 2)
        ]
        qs = groups[..., GROUP * head :].reshape(len(index), nb, -1, GROUP, 4)
        qs = qs.gather(3, (index % GROUP).view(-1, 1, 1, 1, 1).expand(-1, nb, qs.shape[2], 1, 4))
        qs = qs.reshape(len(index), nb, -1)
        if self.base.name == "q8_0":
            qs = qs ^ 0x80
        blocks = torch.cat([p.reshape(len(index), nb, 2) for p in parts] + [qs], dim=2)
        return self.base.dequantize(blocks.reshape(len(index), -1), in_features)

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        return self.interleave(self.base.quantize(weight), int(weight.shape[1]))


def interleaved_formats(bases: dict[str, WeightFormat]) -> list[Interleaved]:
    """The six interleaved formats of Q8_0 / Q4_0 / Q4_1 (C ids 10-12: int16 activations,
    13-15: int8 activations, as ``quant_x16.c`` numbers them)."""
    out = []
    for i, base in enumerate(("q8_0", "q4_0", "q4_1")):
        out.append(Interleaved(bases[base], f"{base}x16", 10 + i, False))  # type: ignore[arg-type]
        out.append(Interleaved(bases[base], f"{base}x16a8", 13 + i, True))  # type: ignore[arg-type]
    return out
