"""Serving under load: loraplex's HTTP server vs HF ``transformers serve``, Poisson arrivals.

Each system runs as its own server process on loopback, with the same weights (the bundled
SmolLM2-135M-Instruct, de-quantised to an HF folder, or ``--model``), float32 on the CPU and
the same number of threads (``--threads``: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``)::

    .venv/bin/python benchmarks/serve_load.py                                   # both systems
    .venv/bin/python benchmarks/serve_load.py --systems loraplex --rates 1,2 --duration-s 10

* loraplex: ``loraplex serve`` with tenants (keys mode, SQLite in a temporary folder),
  ``--tenants`` tenants with an API key each and ``--adapters`` random LoRA adapters (rank 8,
  q/v of every layer) uploaded by the first tenant as public ones; request ``j`` runs as
  tenant ``j % tenants``, on adapter ``j % (adapters + 1)`` (the last slot: the base model).
* peer: ``transformers serve DIR --continuous-batching --device cpu --dtype float32`` (HF's
  OpenAI-compatible server); it has neither tenants nor adapters, so every request goes to the
  base model (the same prompts and ``max_tokens``).

Load, per rate (requests/s): arrivals at Poisson times over ``--duration-s`` (seeded: both
systems see the same arrival times, prompts and lengths), each a streamed ``/v1/completions``
(``temperature 0``, ``max_tokens`` ``--max-tokens``, ``stream_options.include_usage``), sent
by a bounded client (at most ``--max-in-flight`` open connections; a request that waits for a
connection still counts its wait in its time to first token). A request unfinished
``--drain-s`` after the last arrival counts as failed.

Measured per request from its scheduled arrival: TTFT (first chunk with text), inter-token
latency (gaps between chunks with text, per token), end-to-end latency; per rate: p50 / p99
of each, output tokens/s and completed requests/s over the window (first arrival to last
finish). **Goodput** of a system: the highest completed requests/s among the rates where
its p99 TTFT met the SLO (``--slo-ttft-s``, 2 s) and every request completed.

Rates are searched per system (``search_rates``): ``--rates`` is the ascending coarse sweep,
run until the first rate that misses the SLO; then the rate between the highest that met it
and the lowest that missed is bisected (geometric mean) until the two are at most
``--search-ratio`` (1.25) apart or ``--max-probes`` rates ran, so a goodput is never read
off a grid coarser than 1.25x (a x2 grid put loraplex's at 4 req/s when 8 just missed).
``--no-search`` runs the ``--rates`` grid as given (stopping once a system saturates: p99
TTFT over 4x the SLO). The plot draws p50 / p99 TTFT and p50 / p99 end-to-end latency
against the rate for both systems, every probed rate a point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import format_table, machine_info, write_json  # noqa: E402

ADMIN_TOKEN = "serve-load-benchmark-admin-token"
_TEXT = (
    "the a of to and in is that for on with as by at from it this be are was an which or have "
    "not they one all their there more can been has would other when we time into some could "
    "them than then only its now over also after how our work first well way even new want "
    "because any these give day most us model token cache server request latency queue batch"
)
WORDS = tuple(_TEXT.split(" "))


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: str
    max_tokens: int
    index: int


@dataclass
class Outcome:
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model folder (default: the bundled SmolLM2)")
    p.add_argument("--systems", default="loraplex,peer", help="comma list of loraplex, peer")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="request rates (req/s), comma list")
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--drain-s", type=float, default=30.0, help="wait after the last arrival")
    p.add_argument("--prompt-words", type=int, default=48, help="mean words per prompt (uniform +-50%%)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-in-flight", type=int, default=64, help="client connection cap")
    p.add_argument("--tenants", type=int, default=2)
    p.add_argument("--adapters", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=32, help="loraplex --max-num-seqs")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--search-ratio", type=float, default=1.25, help="bisect until met / missed <= this")
    p.add_argument("--max-probes", type=int, default=10, help="most rates run per system")
    p.add_argument("--no-search", action="store_true", help="run the --rates grid only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=str(_ROOT / "benchmarks/results/serve_load.json"))
    p.add_argument("--plot", default=str(_ROOT / "benchmarks/results/serve_load.png"))
    return p.parse_args(argv)


# -- the load ---------------------------------------------------------------------------
def make_arrivals(
    rate: float, duration_s: float, prompt_words: int, max_tokens: int, seed: int
) -> list[Arrival]:
    """Poisson arrivals over ``duration_s`` (exponential gaps), seeded prompts of random words."""
    rng = random.Random(f"{seed}-{rate}")
    arrivals: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        n = rng.randint(max(1, prompt_words // 2), max(1, prompt_words * 3 // 2))
        prompt = " ".join(rng.choice(WORDS) for _ in range(n))
        arrivals.append(Arrival(t, f"Request {len(arrivals)}: {prompt}", max_tokens, len(arrivals)))
        t += rng.expovariate(rate)
    return arrivals


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


async def one_request(
    client: Any,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    start: float,
    gate: asyncio.Semaphore,
) -> Outcome:
    """Send one streamed completion; timings from ``start`` (its scheduled arrival, monotonic)."""
    out = Outcome()
    last = None
    try:
        async with gate, client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}"
                return out
            usage_tokens = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"].get("message"))[:200]
                    return out
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                texts = [c.get("text") or "" for c in event.get("choices", [])]
                if any(texts):
                    now = time.monotonic()
                    out.num_tokens += 1
                    if last is None:
                        out.ttft_s = now - start
                    else:
                        out.itl_s.append(now - last)
                    last = now
            out.e2e_s = time.monotonic() - start
            if usage_tokens is not None:
                out.num_tokens = int(usage_tokens)
            out.ok = out.ttft_s is not None
    except Exception as exc:  # a failed request is counted, the run goes on
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    return out


async def run_rate(system: System, arrivals: list[Arrival], args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    gate = asyncio.Semaphore(args.max_in_flight)
    limits = httpx.Limits(max_connections=args.max_in_flight, max_keepalive_connections=args.max_in_flight)
    async with httpx.AsyncClient(base_url=system.url, timeout=None, limits=limits) as client:
        t0 = time.monotonic()

        async def scheduled(a: Arrival) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + a.at_s - time.monotonic()))
            body, headers = system.request(a)
            return await one_request(client, "/v1/completions", body, headers, t0 + a.at_s, gate)

        tasks = [asyncio.ensure_future(scheduled(a)) for a in arrivals]
        horizon = (arrivals[-1].at_s if arrivals else 0.0) + args.drain_s
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + horizon - time.monotonic()))
        for task in pending:
            task.cancel()
        end = time.monotonic()
        outcomes = [t.result() if t in done else Outcome(error="unfinished") for t in tasks]
    ok = [o for o in outcomes if o.ok]
    # From the start of the rate's window to the last finish (offsets from t0), at least the
    # arrival window itself: a short lucky window never reads as more than the offered rate.
    finished = [
        a.at_s + o.e2e_s for a, o in zip(arrivals, outcomes, strict=True) if o.ok and o.e2e_s is not None
    ]
    window_s = max(max(finished, default=end - t0), args.duration_s)
    window_s = max(window_s, 1e-9)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    itl = [gap for o in ok for gap in o.itl_s]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    # A request that never finished counts as a TTFT over any SLO.
    ttft_all = ttft + [math.inf] * (len(outcomes) - len(ok))
    return {
        "num_requests": len(outcomes),
        "num_ok": len(ok),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "ttft_p50_s": percentile(ttft_all, 50),
        "ttft_p99_s": percentile(ttft_all, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "output_tok_s": sum(o.num_tokens for o in ok) / window_s,
        "requests_per_s": len(ok) / window_s,
    }


# -- the servers ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = str(threads)
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH", "")]))
    return env


class System:
    """A server process under test: ``start``, ``request(arrival)`` -> (body, headers), ``stop``."""

    name = ""

    def __init__(self, args: argparse.Namespace, model_dir: Path, workdir: Path) -> None:
        self.args = args
        self.model_dir = model_dir
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def request(self, a: Arrival) -> tuple[dict[str, Any], dict[str, str]]:
        raise NotImplementedError

    def start(self) -> float:
        """Start the server; seconds until it answered ``/health``."""
        import httpx

        t0 = time.monotonic()
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=thread_env(self.args.threads)
        )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start-up; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.args.start_timeout_s:
                raise RuntimeError(f"{self.name} did not start in {self.args.start_timeout_s} s")
            time.sleep(0.5)
        self.prepare()
        return time.monotonic() - t0

    def prepare(self) -> None:
        """Set-up after start (tenants, adapters) and one warm-up request."""
        import httpx

        body, headers = self.request(Arrival(0.0, "Warm up.", 4, 0))
        httpx.post(f"{self.url}/v1/completions", json={**body, "stream": False}, headers=headers, timeout=300)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class Loraplex(System):
    name = "loraplex"

    def __init__(self, args: argparse.Namespace, model_dir: Path, workdir: Path) -> None:
        super().__init__(args, model_dir, workdir)
        self.keys: list[str] = []
        self.models: list[str] = []

    def command(self) -> list[str]:
        a = self.args
        return [
            sys.executable, "-m", "loraplex.cli", "serve",
            "--model", str(self.model_dir), "--dtype", "float32",
            "--port", str(self.port), "--served-model-name", "base",
            "--max-num-seqs", str(a.max_num_seqs), "--max-loras", str(max(1, a.adapters)),
            "--data-dir", str(self.workdir / "data"), "--admin-token", ADMIN_TOKEN,
            "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip

    def prepare(self) -> None:
        import httpx

        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        for i in range(self.args.tenants):
            r = httpx.post(f"{self.url}/admin/api/tenants", json={"name": f"t{i}"}, headers=admin, timeout=60)
            r.raise_for_status()
            r = httpx.post(f"{self.url}/admin/api/tenants/t{i}/keys", json={}, headers=admin, timeout=60)
            r.raise_for_status()
            self.keys.append(str(r.json()["key"]))
        for j in range(self.args.adapters):
            archive = adapter_zip(self.model_dir, self.workdir / f"adapter{j}", seed=j)
            r = httpx.post(
                f"{self.url}/v1/adapters",
                data={"name": f"lora{j}", "visibility": "public"},
                files={"file": ("adapter.zip", archive, "application/zip")},
                headers={"Authorization": f"Bearer {self.keys[0]}"},
                timeout=300,
            )
            r.raise_for_status()
            self.models.append(f"t0/lora{j}")
        self.models.append("base")
        for i in range(len(self.models)):  # warm every adapter into a slot once
            body, headers = self.request(Arrival(0.0, "Warm up.", 4, i))
            httpx.post(
                f"{self.url}/v1/completions", json={**body, "stream": False}, headers=headers, timeout=300
            )

    def request(self, a: Arrival) -> tuple[dict[str, Any], dict[str, str]]:
        keys, models = self.keys or [""], self.models or ["base"]
        tenant = a.index % len(keys)
        model = models[a.index % len(models)]
        if tenant == 0 and model.startswith("t0/"):
            model = model.removeprefix("t0/")  # the owner names its own adapter without the prefix
        return _body(model, a), {"Authorization": f"Bearer {keys[tenant]}"}


class Peer(System):
    name = "peer"

    def command(self) -> list[str]:
        exe = Path(sys.executable).with_name("transformers")
        return [
            str(exe), "serve", str(self.model_dir), "--continuous-batching",
            "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
        ]  # fmt: skip

    def request(self, a: Arrival) -> tuple[dict[str, Any], dict[str, str]]:
        return _body(str(self.model_dir), a), {}


def _body(model: str, a: Arrival) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": a.prompt,
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def adapter_zip(model_dir: Path, out: Path, seed: int, rank: int = 8) -> bytes:
    """A random PEFT LoRA (q_proj, v_proj of every layer) for ``model_dir``, as a .zip."""
    import io
    import zipfile

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for module, out_features in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(outs),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path in sorted(out.iterdir()):
            zf.write(path, path.name)
    return buf.getvalue()


# -- report ---------------------------------------------------------------------------
def meets_slo(row: dict[str, Any], slo_s: float) -> bool:
    """Every request completed and the p99 TTFT under the SLO."""
    return bool(row["num_ok"] == row["num_requests"] and (row["ttft_p99_s"] or math.inf) < slo_s)


def goodput(rows: list[dict[str, Any]], slo_s: float) -> dict[str, Any] | None:
    """The best rate that met the SLO (p99 TTFT, every request completed), or None."""
    met = [r for r in rows if meets_slo(r, slo_s)]
    return max(met, key=lambda r: r["requests_per_s"], default=None)


def search_rates(
    probe: Callable[[float], dict[str, Any]],
    coarse: Sequence[float],
    slo_s: float,
    ratio: float = 1.25,
    max_probes: int = 10,
) -> list[dict[str, Any]]:
    """The rows of the rates probed to find where ``probe`` stops meeting the SLO, by rate.

    ``coarse`` (ascending) runs until its first miss; then the gap between the highest rate
    that met the SLO and the lowest that missed is halved geometrically until the two are at
    most ``ratio`` apart (or ``max_probes`` rates ran). A first rate that misses, or a sweep
    that never misses, leaves nothing to bisect: the rows say so (goodput None, or the top).
    """
    if ratio <= 1.0:
        raise ValueError(f"search ratio must be > 1, got {ratio}")
    rows: list[dict[str, Any]] = []
    met: float | None = None
    missed: float | None = None
    for rate in coarse:
        row = probe(rate)
        rows.append(row)
        if meets_slo(row, slo_s):
            met = rate
        else:
            missed = rate
            break
    while met is not None and missed is not None and missed / met > ratio and len(rows) < max_probes:
        rate = math.sqrt(met * missed)
        row = probe(rate)
        rows.append(row)
        if meets_slo(row, slo_s):
            met = rate
        else:
            missed = rate
    return sorted(rows, key=lambda r: r["rate"])


def make_plot(results: dict[str, list[dict[str, Any]]], slo_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        rates = [r["rate"] for r in rows]
        for key, style in (("ttft_p50_s", "o-"), ("ttft_p99_s", "s--")):
            ax1.plot(rates, [_finite(r[key]) for r in rows], style, label=f"{name} {key[5:8]}")
        ax2.plot(rates, [_finite(r["e2e_p50_s"]) for r in rows], "o-", label=f"{name} p50")
        ax2.plot(rates, [_finite(r["e2e_p99_s"]) for r in rows], "s--", label=f"{name} p99")
    ax1.axhline(slo_s, color="gray", lw=0.8, ls=":", label=f"SLO {slo_s:g} s")
    for ax, title in ((ax1, "time to first token"), (ax2, "end-to-end latency")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(v: float | None) -> float:
    return float("nan") if v is None or not math.isfinite(v) else v


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from loraplex.platform.model.source import resolve_model_dir

    model_dir = Path(resolve_model_dir(args.model))
    rates = [float(r) for r in args.rates.split(",")]
    classes = {"loraplex": Loraplex, "peer": Peer}
    results: dict[str, list[dict[str, Any]]] = {}
    start_s: dict[str, float] = {}
    workdir = Path(tempfile.mkdtemp(prefix="serve-load-"))
    try:
        for name in args.systems.split(","):
            system = classes[name](args, model_dir, workdir)
            start_s[name] = system.start()
            print(f"{name}: up in {start_s[name]:.1f} s at {system.url}", flush=True)
            rows = results[name] = []

            def probe(rate: float, system: System = system, name: str = name) -> dict[str, Any]:
                arrivals = make_arrivals(rate, args.duration_s, args.prompt_words, args.max_tokens, args.seed)
                row = {"rate": rate, **asyncio.run(run_rate(system, arrivals, args))}
                print(f"  {name} {rate:.3g} req/s: {json.dumps(_rounded(row))}", flush=True)
                return row

            try:
                if args.no_search:
                    for rate in rates:
                        row = probe(rate)
                        rows.append(row)
                        if (row["ttft_p99_s"] or math.inf) > 4 * args.slo_ttft_s:
                            print(f"  {name} saturated at {rate:g} req/s: higher rates skipped", flush=True)
                            break
                else:
                    rows += search_rates(probe, rates, args.slo_ttft_s, args.search_ratio, args.max_probes)
            finally:
                system.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    best = {name: goodput(rows, args.slo_ttft_s) for name, rows in results.items()}
    ratio = None
    if best.get("loraplex") and best.get("peer"):
        ratio = best["loraplex"]["requests_per_s"] / best["peer"]["requests_per_s"]  # type: ignore[index]
    latencies = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s")
    table = format_table(
        ["system", "rate", "ok", *(k[:-2].replace("_", " ") for k in latencies), "tok/s", "req/s"],
        [
            [
                name, r["rate"], f"{r['num_ok']}/{r['num_requests']}",
                *(_fmt(r[k]) for k in latencies),
                f"{r['output_tok_s']:.1f}", f"{r['requests_per_s']:.2f}",
            ]
            for name, rows in results.items()
            for r in rows
        ],
    )  # fmt: skip
    report = {
        "args": vars(args),
        "model_dir": str(model_dir),
        "machine": machine_info(),
        "start_s": start_s,
        "results": results,
        "goodput": {
            name: None if b is None else {"rate": b["rate"], "requests_per_s": b["requests_per_s"]}
            for name, b in best.items()
        },
        # The lowest probed rate above the goodput's that missed the SLO: the search's bracket.
        "first_missed_rate": {
            name: min(
                (
                    r["rate"]
                    for r in rows
                    if not meets_slo(r, args.slo_ttft_s) and r["rate"] > (best[name] or {"rate": 0})["rate"]
                ),
                default=None,
            )
            for name, rows in results.items()
        },
        "goodput_ratio": ratio,
        "table": table,
    }
    print(table)
    print("goodput (best rate under the SLO):", json.dumps(_rounded(report["goodput"])), "ratio:", ratio)
    write_json(args.out, report)
    if args.plot:
        make_plot(results, args.slo_ttft_s, Path(args.plot))
    return report


def _fmt(v: float | None) -> str:
    return "-" if v is None else ("inf" if not math.isfinite(v) else f"{v:.3f}")


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 4) if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


if __name__ == "__main__":
    main()
