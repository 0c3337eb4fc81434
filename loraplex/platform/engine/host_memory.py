"""Keep glibc's malloc from handing the engine's activation memory back to the OS every step.

A CPU forward step allocates and frees tensors of megabytes (a 1,024-token step of
SmolLM2: 12 MB for ``gate_up`` alone). glibc serves blocks above its mmap threshold
with fresh ``mmap`` calls and trims the heap top when enough is free, so those bytes
come back zeroed by the kernel, page by page. Its dynamic threshold adapts to sizes
it has seen (up to 32 MB), so the cost is worst on an engine's first steps and for
any block over 32 MB: the first 1,024-token steps of SmolLM2 took ~128,000 minor
page faults each, ~25% of their time; over a whole benchmark run the gain was
within noise (+3%). Raising the mmap and trim thresholds keeps freed blocks in the
process from the start (the effect jemalloc or tcmalloc give, which the CPU inference
guides of PyTorch and Intel recommend through ``LD_PRELOAD``).

The setting is process-wide: everything else in the process (another model, a
benchmark's peers) gets it too. ``LORAPLEX_MALLOC_TUNING=0`` leaves malloc alone.

The price is that a burst's freed memory (a whole answer of megabytes of logprobs, a long
prefill's activations) stays in the process. ``trim_host_malloc`` gives it back; the engine
thread calls it once each time it has been idle for ``IDLE_TRIM_S``, where the page faults of
the next first step cost nothing that matters.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import time

logger = logging.getLogger(__name__)

ENV_SWITCH = "LORAPLEX_MALLOC_TUNING"
# The setting ``malloc_tuning`` of ``loraplex serve`` (``ProcessSettings``, platform/settings): the
# server exports its effective value into this variable before the engine starts, so this module
# reads one place whether the value came from a flag, the config file or the environment.
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size are kept for reuse instead of being mapped and unmapped each
# time: above the largest per-step activation of the configurations we serve.
THRESHOLD_BYTES = 1 << 30


IDLE_TRIM_S = 2.0
"""How long the engine is idle before its freed host memory goes back to the OS."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to do
        return None
    return libc


def trim_host_malloc() -> bool:
    """Give the heap's free memory back to the OS (glibc's ``malloc_trim(0)``), if this process
    tuned malloc; True if anything was released."""
    libc = _libc()
    if libc is None or not tune_host_malloc():
        return False
    return bool(libc.malloc_trim(0))


@functools.cache
def tune_host_malloc() -> bool:
    """Apply the thresholds once per process; True if glibc accepted them."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    libc = _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    ok = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES)
    )
    if ok:
        logger.info("malloc: mmap and trim thresholds raised to %d MiB", THRESHOLD_BYTES >> 20)
    else:
        logger.warning("malloc: glibc refused the mmap/trim thresholds; steps may page-fault")
    return ok


class IdleTrim:
    """Once per idle period of ``IDLE_TRIM_S``, the freed host memory goes back to the OS
    (``host_memory``: malloc keeps it while the engine runs)."""

    def __init__(self) -> None:
        self._idle_since: float | None = None
        self._trimmed = True  # nothing ran yet

    def busy(self) -> None:
        self._idle_since = None
        self._trimmed = False

    def tick(self) -> None:
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif not self._trimmed and now - self._idle_since >= IDLE_TRIM_S:
            self._trimmed = True
            trim_host_malloc()
