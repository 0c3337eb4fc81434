"""``build.SOURCES`` names every C file of ``loraplex/kernels/cpu``: one left out would still link
(a shared library may leave symbols undefined) and fail only when the library is loaded or a
kernel is bound, and since the cache key hashes every ``*.c`` / ``*.h`` there, nothing else
would notice."""

from __future__ import annotations

from pathlib import Path

from loraplex.kernels.cpu import build


def test_every_c_file_is_compiled() -> None:
    here = Path(build.__file__).parent
    assert sorted(build.SOURCES) == sorted(path.name for path in here.glob("*.c"))
