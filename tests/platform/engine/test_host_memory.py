"""The malloc thresholds the engine sets on the CPU (process-wide, glibc only)."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from loraplex.platform.engine import host_memory


def test_switch_off_leaves_malloc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.ENV_SWITCH, "0")
    host_memory.tune_host_malloc.cache_clear()
    try:
        assert host_memory.tune_host_malloc() is False
    finally:
        host_memory.tune_host_malloc.cache_clear()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_freed_activations_are_reused_without_page_faults() -> None:
    """After tuning, allocating and freeing a 48 MB tensor again costs no fresh pages (glibc maps
    anything over 32 MB afresh on every allocation by default, however often it recurs)."""
    host_memory.tune_host_malloc.cache_clear()
    assert host_memory.tune_host_malloc() is True

    def churn() -> None:
        for _ in range(5):
            t = torch.empty(4096, 3072)
            t.fill_(1.0)  # touch every page
            del t

    for _ in range(3):  # the first rounds grow the heap, taking pages from the OS
        churn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 500, f"{faults} minor page faults: freed blocks went back to the OS"  # untuned: ~61,000
