"""Model families side by side: each family's tokens/s on a same-size tiny random model, vs Llama's.

One process, the same shapes for every family (hidden 512, 4 layers, 8 heads, 4 KV heads,
head_dim 64, MLP 1408, vocab 8192), random weights, float32, the engine's default backends
on this machine, and one seeded workload (``--requests`` prompts of ``--prompt`` tokens, each
generating ``--output`` tokens, EOS ignored). Each family's parts are on, as in the fidelity
tests: a 64-token sliding window (Qwen2's upper layers, Mistral and Phi-3 every layer,
Gemma's local layers), Gemma 2's soft-capping, Gemma 3's two RoPE bases, Qwen3 / Gemma 3's
q/k norm, Phi-3's LongRoPE. Rounds alternate the family order; the table gives the median
tokens/s per family and its ratio to Llama's::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/model_families.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.common import format_table, machine_info, set_torch_threads  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
WINDOW = 64


def family_config(family: str) -> Any:
    """The benchmark's shapes for ``family``, with its parts on."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    layers = 4
    common: dict[str, Any] = dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=64)
    if family == "mistral":
        return MistralConfig(**common, head_dim=64, sliding_window=WINDOW)
    if family == "gemma2":
        return Gemma2Config(
            **common,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            attn_logit_softcapping=50.0,
        )
    if family == "gemma3":
        return Gemma3TextConfig(
            **common,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        )
    if family == "phi3":
        return Phi3Config(
            **common,
            original_max_position_embeddings=1024,
            sliding_window=WINDOW,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 32,
                "long_factor": [2.0] * 32,
            },
        )
    raise ValueError(family)


def make_model(family: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    out = root / family
    model.save_pretrained(out, safe_serialization=True)
    return out


def run(model_dir: Path, prompts: list[list[int]], output: int) -> tuple[float, str]:
    """(generated tokens per second, why the CPU graph is off or "") of one run."""
    from loraplex import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=1024, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    model = llm.llm_engine.model
    graph = "graph" if getattr(model, "_graph", None) is not None else "layers"
    return tokens / elapsed, graph


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    set_torch_threads(args.threads)
    families = args.families.split(",")
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8192) for _ in range(args.prompt)] for _ in range(args.requests)]
    rates: dict[str, list[float]] = {f: [] for f in families}
    paths: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {f: make_model(f, Path(tmp)) for f in families}
        for r in range(args.rounds):
            order = families if r % 2 == 0 else list(reversed(families))
            for f in order:
                rate, paths[f] = run(dirs[f], prompts, args.output)
                rates[f].append(rate)
    base = statistics.median(rates["llama"]) if "llama" in rates else float("nan")
    rows = []
    for f in families:
        med = statistics.median(rates[f])
        rows.append([f, paths[f], med, min(rates[f]), max(rates[f]), med / base])
    print(machine_info())
    print(
        f"{args.requests} requests x {args.prompt} prompt + {args.output} output tokens, "
        f"{args.rounds} rounds, {args.threads} threads, window {WINDOW}"
    )
    print(format_table(["family", "path", "tok/s median", "min", "max", "vs llama"], rows, floatfmt=".2f"))


if __name__ == "__main__":
    main()
