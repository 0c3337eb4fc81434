"""Compile the CPU backend's C kernels on first use and load them with ctypes.

The kernels are plain C (no torch headers): a build takes ~10 s on two cores (the paged
extend kernel's tiles, instantiated per row count and dtype, are most of it), once per
source version and machine. The library is built for the host CPU
(``-march=native``) into ``<cache>/kernels/`` under a name that hashes the sources,
the flags, the compiler and the CPU's feature flags, so a changed source, compiler or
machine gets a fresh build and concurrent builders (pytest workers) never clash:
each writes a private file and renames it into place.

It links OpenMP with ``-fopenmp``; since torch is imported first and its bundled
``libgomp.so.1`` has the same soname, the loader reuses torch's OpenMP runtime, so
the kernels share torch's thread pool instead of starting a second one that would
spin against it on a small machine.

Set ``LORAPLEX_CPU_KERNELS=0`` to disable them; without a C compiler, or if the
build fails, ``load_library`` returns None (with one warning) and the engine runs
the portable (pure PyTorch) backends.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loraplex.paths import cache_root

logger = logging.getLogger(__name__)

SOURCES = (
    "paged_decode.c",
    "paged_extend.c",
    "lora_grouped.c",
    "linear_panels.c",
    "pointwise.c",
    "kv_write.c",
    "quant_linear.c",  # the block formats' projection (their decoders: quant_blocks.h)
    "quant_x16.c",  # the interleaved formats' projection (its AVX2 tiles: quant_x16_avx2.h)
    "quant_x16_quantize.c",  # their activation quantizers
    "quant_x16_layout.c",  # their layout: GGUF rows interleaved in place, rows read back
    "quant_amx.c",
)  # compiled, each to its own object with the same CFLAGS; every *.c and *.h here goes into the cache key
CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-std=gnu11",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    # Let reductions (dot products, sums) reassociate into vector trees; NaN and inf
    # semantics stay IEEE (no -ffinite-math-only), which the softmax relies on.
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
)
ENV_SWITCH = "LORAPLEX_CPU_KERNELS"
"""Off ("0", "false", "no", "off"): ``load_library`` returns None and the torch path runs."""
AMX_ENV_SWITCH = "LORAPLEX_AMX"
"""Read by the C code itself (``quant_amx.c``'s probe, with ``getenv``): "0", "off" or "false" keep
the tile unit off."""
# Both are settings of ``loraplex serve`` (``cpu_kernels`` and ``amx``, ``ProcessSettings`` in
# loraplex/platform/settings), which exports their effective values into these variables before
# the kernels load: the kernels never import the platform, and the C probe reads only the
# environment. Offline users (``LLM``, the benchmarks) set the variables themselves.


def _cpu_signature() -> str:
    """The host's CPU model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(wanted[:2])


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def library_path(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the library for these sources, flags (``CFLAGS`` then ``extra_flags``), compiler and
    CPU lives."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for source in sorted([*here.glob("*.c"), *here.glob("*.h")]):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    for part in (" ".join((*CFLAGS, *extra_flags)), compiler, _compiler_version(compiler), _cpu_signature()):
        digest.update(part.encode())
    return cache_root() / "kernels" / f"libloraplex_cpu-{digest.hexdigest()[:16]}.so"


def build(compiler: str, target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile ``SOURCES`` into ``target`` (atomically: a private file, then a rename).

    Each source compiles to an object on its own thread (the paged extend kernel alone takes
    ~12 s at -O3), then one link. ``extra_flags`` go after ``CFLAGS``: tests build the other
    vector units' code paths with them (``-mno-avx512f``, ``-mno-avx2``), which
    ``-march=native`` alone never does.
    """
    here = Path(__file__).resolve().parent
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = [*CFLAGS, *extra_flags]
    with tempfile.TemporaryDirectory(prefix=target.stem, dir=target.parent) as work:

        def run(cmd: list[str]) -> None:
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")

        objects = [str(Path(work) / f"{Path(name).stem}.o") for name in SOURCES]
        compile_only = [flag for flag in flags if flag != "-shared"]
        with ThreadPoolExecutor(max_workers=min(len(SOURCES), os.cpu_count() or 1)) as pool:
            jobs = [
                pool.submit(run, [compiler, *compile_only, "-c", "-o", obj, str(here / name)])
                for name, obj in zip(SOURCES, objects, strict=True)
            ]
            for job in jobs:
                job.result()
        tmp = str(Path(work) / target.name)
        run([compiler, *flags, "-o", tmp, *objects, "-lm"])
        os.replace(tmp, target)


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when disabled or unbuildable (then torch is used)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC): the CPU backend falls back to pure torch")
        return None
    import torch  # noqa: F401  (load torch's libgomp first, so the kernels share its OpenMP runtime)

    try:
        target = library_path(compiler)
        if not target.exists():
            logger.info("building CPU kernels into %s", target)
            build(compiler, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU kernels unavailable, falling back to pure torch: %s", exc)
        return None


@functools.cache
def bind(symbol: str, argtypes: tuple[Any, ...]) -> Any | None:
    """The C function ``symbol`` with its ctypes signature set (returns int64), or None
    when the library is unavailable. Cached: the engine calls it per layer per step."""
    lib = load_library()
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int64
    return fn


@functools.cache
def limit(symbol: str) -> int:
    """A compile-time limit the library exports as ``int64_t symbol(void)`` (0 if unavailable)."""
    fn = bind(symbol, ())
    return 0 if fn is None else int(fn())


def clear_caches() -> None:
    """Forget the loaded library and bound functions (tests that toggle the switch or CC)."""
    load_library.cache_clear()
    bind.cache_clear()
    limit.cache_clear()
