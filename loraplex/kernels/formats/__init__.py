"""Weight formats a projection may be kept in, one module each (the ``WeightFormat`` contract).

| module | format | block | bytes | value |
|---|---|---|---|---|
| ``q8_0`` | ``q8_0`` | 32 | 34 | ``d * q`` (f16 d, int8 q) |
| ``q4_0`` | ``q4_0`` | 32 | 18 | ``d * (q - 8)`` (f16 d, 4-bit q) |
| ``q4_1`` | ``q4_1`` | 32 | 20 | ``d * q + m`` (f16 d, m, 4-bit q) |
| ``k_quants`` | q4_k | 256 | 144 | ``d * sc[s] * q - dmin * m[s]`` (8 sub-blocks, 6-bit sc, m) |
| | q6_k | 256 | 210 | ``d * sc[s] * (q - 32)`` (16 sub-blocks, int8 sc, 6-bit q) |
| ``floats`` | f16, bf16, f32 | 16 | 32, 32, 64 | the float |
| ``int8`` | ``int8`` | 16 | 16 | ``scale[row] * q`` (a float32 scale after each row) |
| ``interleaved`` | ``q8_0x16``, ``q4_0x16``, ``q4_1x16``, ``*a8`` | 32 | 34, 18, 20 | 16 rows interleaved |
| ``blocks`` | | | | byte helpers the references share |

The GGUF block layouts are ggml's (``ggml-common.h``); each module's ``dequantize`` is the
torch reference and gives the same floats as ``gguf.quants`` (tested). ``c_id`` names the
format in ``cpu/quant_linear.c`` and ``triton/quant_linear.py``. A new format is a module
here with its ``WeightFormat`` and an entry in ``FORMATS``; the kernels then add its block
decoder (one function each).
"""

from __future__ import annotations

from loraplex.kernels.contracts import WeightFormat, WeightFormatName
from loraplex.kernels.formats.floats import BF16, F16, F32
from loraplex.kernels.formats.int8 import Int8PerChannel
from loraplex.kernels.formats.interleaved import interleaved_formats
from loraplex.kernels.formats.k_quants import Q4K, Q6K
from loraplex.kernels.formats.q4_0 import Q4_0
from loraplex.kernels.formats.q4_1 import Q4_1
from loraplex.kernels.formats.q8_0 import Q8_0

FORMATS: dict[WeightFormatName, WeightFormat] = {
    fmt.name: fmt for fmt in (F32(), F16(), BF16(), Q8_0(), Q4_0(), Q4_1(), Q4K(), Q6K(), Int8PerChannel())
}
FORMATS.update({fmt.name: fmt for fmt in interleaved_formats(FORMATS)})  # type: ignore[arg-type]

__all__ = ["FORMATS"]
