"""benchmarks/gpu_kernels.py keeps working: its ``--cpu-smoke`` mode runs every section.

The GPU script is meant to run once, unattended, on a borrowed GPU; this runs its
correctness section at tiny sizes and its timing sections at toy sizes on the CPU
(Triton interpreted), in a subprocess as a user would start it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_script_cpu_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_kernels.py"), "--cpu-smoke", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "gpu_kernels_cpu_smoke.json").read_text())
    checks = results["correctness"]
    assert checks and all(row["ok"] for row in checks)
    names = {row["check"].split(" ")[0] for row in checks}
    for kernel in (
        "paged_decode", "extend_attention", "write_kv", "copy_blocks", "copy_blocks_between",
        "bgmv_shrink", "sgmv_shrink", "bgmv_expand", "sgmv_expand",
        "TritonAttentionBackend.forward", "TritonLoRABackend.apply", "TritonLoRABackend.apply_paged",
    ):  # fmt: skip
        assert kernel in names, f"no correctness check for {kernel}"
    assert {row["dtype"] for row in checks} == {"bfloat16"}
    assert len(results["decode"]) == 2 and len(results["lora"]) == 6
    assert [row["phase"] for row in results["lora_paged"]] == ["decode", "prefill"]
    assert all(row["passes"] == 8 for row in results["lora_paged"])
