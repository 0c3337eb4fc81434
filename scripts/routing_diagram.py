"""Draw the routed deployment (docs/deployment.md's picture) into docs/img/routed-deployment.png.

    python scripts/routing_diagram.py [--out PATH]

Boxes and arrows only, from the chart's own names and ports (helm/loraplex/values.yaml:
containerPort, metricsPort, router.kvEvents, router.picker), so the picture can be redrawn when
they change.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

ROOT = Path(__file__).resolve().parents[1]

# Colours per role: traffic, the router, the replicas, shared services, observability.
TRAFFIC, ROUTER, REPLICA, SHARED, OBSERVE = "#dbe9f6", "#fde2c8", "#d9f0d3", "#eeeeee", "#efe3f5"


def box(ax, x: float, y: float, w: float, h: float, title: str, body: str, colour: str) -> None:
    """One component: a bold title over smaller lines of what it holds or serves."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=colour, ec="#444", lw=1.2
        )
    )
    ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=10.5, weight="bold")
    if body:
        ax.text(x + w / 2, y + h - 0.6, body, ha="center", va="top", fontsize=8.2, linespacing=1.35)


def arrow(ax, start, end, label: str = "", colour: str = "#333", style: str = "-|>", **text) -> None:
    """A labelled connection; dashed for what the router or Prometheus reads, solid for requests."""
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle=style,
            mutation_scale=13,
            color=colour,
            lw=1.3,
            linestyle=text.pop("linestyle", "-"),
            shrinkA=2,
            shrinkB=2,
        )
    )
    if label:
        x = text.pop("x", (start[0] + end[0]) / 2)
        y = text.pop("y", (start[1] + end[1]) / 2)
        ax.text(x, y, label, fontsize=7.8, color=colour, ha="center", va="center", **text)


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 9.2))
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 9.2)
    ax.axis("off")

    box(ax, 4.1, 8.1, 4.4, 0.9, "clients", "OpenAI API, tenant keys (Bearer)", TRAFFIC)
    box(
        ax,
        3.4,
        6.4,
        5.8,
        1.2,
        "gateway (Envoy: Istio, kgateway, GKE, ...)",
        "HTTPRoute -> backendRef: the release's InferencePool\n"
        "asks the picker per request (ext_proc), sends to its pick",
        TRAFFIC,
    )
    box(
        ax,
        10.0,
        5.95,
        2.85,
        2.0,
        "endpoint picker",
        "llm-d EPP (router.picker)\n"
        "scorers: prefix, LoRA,\nqueue, KV usage -> max score\n"
        "watches the pool's pods\n(selector, Kubernetes API)",
        ROUTER,
    )
    box(
        ax,
        0.15,
        6.0,
        2.85,
        1.6,
        "Prometheus",
        "scrapes :9090 /metrics\n(ServiceMonitor on the\n-metrics Service); HPA / KEDA",
        OBSERVE,
    )

    # The replicas: one pod each, three ports besides the serving one.
    replica_body = (
        ":8000  OpenAI API + admin (auth)\n"
        ":9090  metrics_port: GET /metrics only (vllm:*, loraplex_*)\n"
        ":5557  KV events PUB (ZeroMQ), :5558 replay (ROUTER)\n"
        "engine: weights, KV tiers, adapter slots"
    )
    xs = (0.15, 4.4, 8.65)
    width, top = 4.05, 4.85
    for i, x in enumerate(xs):
        box(ax, x, 2.95, width, top - 2.95, f"replica {i}" if i < 2 else "replica N", replica_body, REPLICA)

    box(ax, 0.35, 0.2, 3.7, 1.2, "PostgreSQL", "tenants, key hashes, adapter rows, usage", SHARED)
    box(
        ax,
        4.6,
        0.2,
        3.7,
        1.2,
        "Redis",
        "quotas (one Lua script per admission)\nreplica events (pub/sub)",
        SHARED,
    )
    box(ax, 8.85, 0.2, 3.7, 1.2, "adapter store", "ReadWriteMany volume\ncontent-addressed versions", SHARED)

    # Requests.
    arrow(ax, (6.3, 8.1), (6.3, 7.6), "HTTPS", x=6.75)
    arrow(ax, (9.2, 7.0), (10.0, 7.0), "", colour="#b35900", style="<|-|>")
    ax.text(9.6, 7.15, "ext_proc\ngRPC :9002", fontsize=7.5, color="#b35900", ha="center", va="bottom")
    for x in xs:
        arrow(ax, (6.3, 6.4), (x + width / 2, top), colour="#1f4e79")
    ax.text(
        6.3,
        5.55,
        "request -> the picked pod's :8000",
        fontsize=8,
        color="#1f4e79",
        ha="center",
        bbox={"fc": "white", "ec": "none", "pad": 1},
    )

    # What the picker reads from every pod (dashed): metrics, and KV events for the precise scorer.
    for x, end in zip(xs, (10.25, 11.0, 12.2), strict=True):
        arrow(ax, (x + width - 0.35, top), (end, 5.95), colour="#b35900", linestyle="--")
    ax.text(
        12.9,
        5.45,
        "pulls :9090 /metrics;\nsubscribes :5557 kv@...\n(precise prefix scorer)",
        fontsize=7.5,
        color="#b35900",
        ha="right",
        va="center",
        bbox={"fc": "white", "ec": "none", "pad": 1},
    )
    for x in xs:
        arrow(ax, (1.3, 6.0), (x + 0.45, top), colour="#6a3d7c", linestyle="--")

    # Shared services on one bus: every replica reaches all three.
    bus = 2.1
    ax.plot([xs[0] + width / 2, xs[-1] + width / 2], [bus, bus], color="#555", lw=1.3)
    for x in xs:
        ax.plot([x + width / 2, x + width / 2], [2.95, bus], color="#555", lw=1.3)
    for x in (2.2, 6.45, 10.7):
        arrow(ax, (x, bus), (x, 1.4), colour="#555", style="<|-|>")
    ax.text(
        6.45,
        2.45,
        "every replica: PostgreSQL, Redis, the store; replica events (key revoked, tenant changed /"
        " deleted, adapter changed) through Redis",
        fontsize=7.8,
        ha="center",
        color="#333",
        bbox={"fc": "white", "ec": "none", "pad": 1},
    )

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "routed-deployment.png")
    args = parser.parse_args()
    draw(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
