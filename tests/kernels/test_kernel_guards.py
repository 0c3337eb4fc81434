"""The checks in front of the C kernels' raw-pointer calls are ``if ...: raise``, not ``assert``:
under ``python -O`` an assert is gone, and a wrong shape or dtype would reach the kernel as a
pointer to memory it does not own (issue 44)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import loraplex

KERNEL_WRAPPERS = (
    "kernels/cpu/linear.py",
    "kernels/cpu/quant_linear.py",
    "kernels/cpu/lora.py",
    "kernels/cpu/paged_decode.py",
    "kernels/cpu/paged_extend.py",
)


def test_no_assert_guards_a_kernel_call() -> None:
    root = Path(loraplex.__file__).parent
    found = [
        f"{name}:{node.lineno}"
        for name in KERNEL_WRAPPERS
        for node in ast.walk(ast.parse((root / name).read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert not found, found


@pytest.mark.slow
def test_a_wrong_input_is_refused_under_python_o() -> None:
    script = (
        "import torch\n"
        "from loraplex.kernels.cpu.linear import linear_packed, pack_weight, c_kernel\n"
        "assert False, 'asserts run: not -O'\n"
    )
    # Under -O the assert above is skipped; a float64 input must still be refused by the wrapper.
    script += (
        "packed = pack_weight(torch.randn(8, 4))\n"
        "try:\n"
        "    linear_packed(torch.randn(2, 4, dtype=torch.float64), packed, None, 8)\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    run = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: float32 only" in run.stdout, run.stdout
