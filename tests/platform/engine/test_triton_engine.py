"""The engine end to end on the Triton backends (CPU interpreter) equals the torch path.

Runs in a subprocess because ``TRITON_INTERPRET`` must be set before triton is first
imported, whatever other tests in this process imported already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys
from loraplex import LLM, LoRARequest, SamplingParams
model_dir, adapter_dir, backend = sys.argv[1], sys.argv[2], sys.argv[3]
llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=8,
          max_num_batched_tokens=24, attention_backend=backend, lora_backend=backend,
          enable_lora=True, max_loras=2, max_lora_rank=16)
lora = LoRARequest("a", 1, adapter_dir)
prompts = [[5, 6, 7], list(range(100, 140)), [9] * 17, list(range(300, 321))]
loras = [None, lora, lora, None]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=1)
outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
# n = 2 exercises fork + copy-on-write block copies through the backend.
fork_params = SamplingParams(temperature=0, max_tokens=4, n=2, ignore_eos=True)
fork = llm.generate([list(range(50, 70))], fork_params, use_tqdm=False)
llm.llm_engine.check_integrity()
print(json.dumps([o.outputs[0].token_ids for o in outs] + [c.token_ids for c in fork[0].outputs]))
"""


def _run(model_dir: Path, adapter_dir: Path, backend: str) -> list[list[int]]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), str(adapter_dir), backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return list(json.loads(res.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_engine_triton_interpreter_matches_torch(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from support.adapters import make_peft_adapter

    base = tiny_dirs["gqa_tied"]
    make_peft_adapter(
        base, tmp_path / "a", seed=3, spec=dict(r=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    )
    torch_tokens = _run(base, tmp_path / "a", "torch")
    triton_tokens = _run(base, tmp_path / "a", "triton")
    assert triton_tokens == torch_tokens
    assert len(torch_tokens) == 6 and all(len(t) in (4, 6) for t in torch_tokens)


MIXED_RANKS_SCRIPT = r"""
import json, sys
from loraplex import LLM, LoRARequest, SamplingParams
model_dir, backend, adapter_dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=8,
          max_num_batched_tokens=40, attention_backend=backend, lora_backend=backend,
          enable_lora=True, max_loras=3, max_lora_rank=32)
loras = [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(adapter_dirs)]
prompts = [[5, 6, 7], list(range(100, 130)), [9] * 17, list(range(300, 321)), [11, 12], list(range(200, 218))]
per_prompt = [loras[0], loras[1], loras[2], None, loras[1], loras[0]]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=1)
outs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
llm.llm_engine.check_integrity()
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


@pytest.mark.slow
def test_engine_triton_interpreter_mixed_ranks_matches_torch(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Adapters of ranks 4, 16 and 24 (pages of 8: one, two and three page passes) in one
    batch of decodes and prefill chunks: Triton's fused ``apply_paged`` equals the torch path."""
    from support.adapters import make_peft_adapter

    base = tiny_dirs["gqa_tied"]
    specs = [
        dict(r=4, target_modules=["q_proj", "v_proj"]),
        dict(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
        dict(r=24, target_modules=["q_proj", "v_proj", "up_proj"]),
    ]
    dirs = []
    for i, spec in enumerate(specs):
        make_peft_adapter(base, tmp_path / f"a{i}", seed=10 + i, spec=spec)
        dirs.append(str(tmp_path / f"a{i}"))
    runs = {}
    for backend in ("torch", "triton"):
        res = subprocess.run(
            [sys.executable, "-c", MIXED_RANKS_SCRIPT, str(base), backend, *dirs],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        runs[backend] = json.loads(res.stdout.strip().splitlines()[-1])
    assert runs["triton"] == runs["torch"]
