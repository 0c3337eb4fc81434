"""Sliding window: a long decode holds the KV of its window, not of its context, at flat speed.

One request decodes ``--gen`` (4,608) tokens after a ``--prompt-len`` (64) token prompt, so
its context reaches 4,672 tokens, 4,096 and more past a ``--window`` (512) token window.
Two peers in one process, on the same random weights, dtype and threads:

* ``window``: a Mistral-style model with ``sliding_window = --window``; its KV pool is
  ``--window-pool`` (64) blocks of 16, a fifth of what the whole context would need;
* ``full``: the same weights with the window off (full attention; HF would compute
  something else past the window: this is the cost of not having one), with a pool that
  holds the whole context.

Each engine step is timed; the figure per position bin (``--bin``, 256 tokens) is 1 / the
median step time in it (the mean is in the JSON too), and the most KV blocks the sequence
held in it::

    .venv/bin/python benchmarks/sliding_window.py --plot docs/img/sliding_window.png   # full run
    .venv/bin/python benchmarks/sliding_window.py --gen 1024 --window 128              # quick check

The model is a random Mistral (``--hidden`` 512, ``--layers`` 8, 8 heads, 2 KV heads, SmolLM2's
tokenizer and vocabulary), big enough that attention over 4k tokens costs as much as the
weights; it is made once in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_torch_threads, write_json  # noqa: E402

DEFAULT_OUT = RESULTS_DIR / "sliding_window.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen", type=int, default=4608, help="generated tokens (EOS ignored)")
    p.add_argument("--bin", type=int, default=256, help="positions per figure bin")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window-pool", type=int, default=64, help="KV blocks of the windowed engine")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--peers", default="window,full", help="comma-separated: window, full")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--plot", default=None, help="PNG path for tokens/s and KV blocks vs position")
    return p.parse_args(argv)


def make_models(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """Save one random Mistral twice: with the window, and with ``sliding_window`` null."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    from loraplex.platform.model.source import resolve_model_dir

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        sliding_window=args.window,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.05)
    tokenizer_dir = resolve_model_dir(None)
    dirs = {"window": root / "window", "full": root / "full"}
    model.save_pretrained(dirs["window"], safe_serialization=True)
    shutil.copytree(dirs["window"], dirs["full"])
    config = json.loads((dirs["full"] / "config.json").read_text())
    config["sliding_window"] = None
    (dirs["full"] / "config.json").write_text(json.dumps(config))
    for folder in dirs.values():
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, folder / name)
    return dirs


def run_peer(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One request's decode, step by step: (position, seconds, blocks held) per step."""
    from loraplex import LLM, SamplingParams

    total = args.prompt_len + args.gen
    bs = args.block_size
    pool = args.window_pool if name == "window" else -(-total // bs) + 8
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=bs,
        num_kv_blocks=pool,
        max_num_seqs=1,
        num_threads=args.threads,
        max_model_len=total + 1,
    )
    engine = llm.llm_engine
    bm = engine.kv.block_manager
    prompt = [3 + (i * 7919) % 40000 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    engine.add_request("r0", prompt, params)
    positions: list[int] = []
    seconds: list[float] = []
    blocks: list[int] = []
    position = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        position = args.prompt_len if not positions else position + 1
        positions.append(position)
        seconds.append(elapsed)
        blocks.append(bm.num_blocks - bm.num_free_blocks)
    engine.check_integrity()
    info = engine.info
    return {
        "peer": name,
        "pool_blocks": pool,
        "kv_bytes_per_block": info.kv_bytes_per_block,
        "window_freed_blocks": bm.num_window_freed_blocks,
        "positions": positions,
        "seconds": seconds,
        "blocks": blocks,
    }


def bins(run: dict[str, Any], width: int) -> list[dict[str, Any]]:
    """Decode steps (the prefill step aside) grouped by position: tokens/s (1 / the median step,
    so a hiccup of the machine does not move a bin) and the most blocks held in the bin (the
    last step frees the request's blocks)."""
    out: list[dict[str, Any]] = []
    steps = list(zip(run["positions"][1:], run["seconds"][1:], run["blocks"][1:], strict=True))
    for lo in range(0, max(p for p, _, _ in steps) + 1, width):
        chunk = [(p, s, b) for p, s, b in steps if lo <= p < lo + width]
        if chunk:
            out.append(
                {
                    "position": chunk[-1][0] + 1,
                    "tokens_per_s": 1.0 / statistics.median(s for _, s, _ in chunk),
                    "mean_tokens_per_s": len(chunk) / sum(s for _, s, _ in chunk),
                    "blocks": max(b for _, _, b in chunk),
                }
            )
    return out


def plot(results: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for peer, colour in (("window", "tab:blue"), ("full", "tab:red")):
        if peer not in results["bins"]:
            continue
        b = results["bins"][peer]
        label = f"window {args.window}" if peer == "window" else "no window (full attention)"
        ax1.plot([x["position"] for x in b], [x["tokens_per_s"] for x in b], "o-", color=colour, label=label)
        ax2.plot([x["position"] for x in b], [x["blocks"] for x in b], "o-", color=colour, label=label)
    for ax in (ax1, ax2):
        ax.axvline(args.window, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("context position (tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("decode tokens/s")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel(f"KV blocks held ({args.block_size} tokens each)")
    ax2.set_ylim(bottom=0)
    fig.suptitle(
        f"One request decoding {args.gen} tokens, random Mistral {args.hidden}x{args.layers}, "
        f"fp32, {args.threads} threads"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    set_torch_threads(args.threads)
    peers = [p for p in args.peers.split(",") if p]
    with tempfile.TemporaryDirectory(prefix="loraplex-window-bench-") as tmp:
        dirs = make_models(Path(tmp), args)
        runs = {peer: run_peer(peer, dirs[peer], args) for peer in peers}
    results: dict[str, Any] = {
        "args": vars(args),
        "machine": machine_info(),
        "bins": {peer: bins(run, args.bin) for peer, run in runs.items()},
        "runs": {
            peer: {k: v for k, v in run.items() if k not in ("positions", "seconds", "blocks")}
            for peer, run in runs.items()
        },
    }
    rows = []
    for peer, b in results["bins"].items():
        run = runs[peer]
        speeds = [x["tokens_per_s"] for x in b]
        first_past = [x["tokens_per_s"] for x in b if x["position"] > args.window]
        rows.append(
            [
                peer,
                run["pool_blocks"],
                max(run["blocks"]),
                max(run["blocks"]) * run["kv_bytes_per_block"] / 2**20,
                speeds[0],
                first_past[0] if first_past else float("nan"),
                speeds[-1],
                speeds[-1] / statistics.median(first_past[:2] or speeds[:1]),
            ]
        )
    headers = [
        "peer",
        "pool blocks",
        "most blocks held",
        "most KV MiB",
        "tok/s first bin",
        "tok/s past window",
        "tok/s last bin",
        "last / past window",
    ]
    print(format_table(headers, rows, floatfmt=".2f"))
    results["table"] = {"headers": headers, "rows": rows}
    write_json(args.out, results)
    if args.plot:
        plot(results, Path(args.plot), args)
        print(f"plot: {args.plot}")
    return results


if __name__ == "__main__":
    main()
