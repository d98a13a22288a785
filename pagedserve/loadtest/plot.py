"""Plots for a bench.py result: latency CDFs (TTFT, TPOT/ITL, E2E) and throughput over time.

    python -m pagedserve.loadtest.plot result.json out.png
"""
from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import orjson  # noqa: E402


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_result(result: dict, path: str) -> str:
    reqs = [r for r in result.get("requests", []) if r.get("success")]
    ttft = [r["ttft_s"] * 1000 for r in reqs]
    e2e = [r["e2e_s"] * 1000 for r in reqs]
    itl = [x * 1000 for r in reqs for x in r.get("itl_s", [])]
    tpot = [
        (r["e2e_s"] - r["ttft_s"]) * 1000 / (r["completion_tokens"] - 1)
        for r in reqs
        if r.get("completion_tokens") and r["completion_tokens"] > 1
    ]
    m = result.get("metrics", {})
    cfg = result.get("config", {})

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    title = (
        f"{cfg.get('model')} {cfg.get('endpoint')} {cfg.get('dataset_name')} "
        f"n={m.get('num_prompts')} conc={cfg.get('max_concurrency') or 'inf'} "
        f"rate={cfg.get('request_rate') or 'inf'} failed={m.get('failed')}"
    )
    fig.suptitle(title, fontsize=10)

    ax = axes[0][0]
    _cdf(ax, ttft, "TTFT")
    ax.set_title("Time to first token")
    ax.set_xlabel("ms")

    ax = axes[0][1]
    _cdf(ax, tpot, "TPOT")
    _cdf(ax, itl, "ITL")
    ax.set_title("Time per output token / inter-token latency")
    ax.set_xlabel("ms")

    ax = axes[1][0]
    _cdf(ax, e2e, "E2E")
    ax.set_title("End-to-end latency")
    ax.set_xlabel("ms")

    for a in (axes[0][0], axes[0][1], axes[1][0]):
        a.set_ylabel("fraction of requests" if a is not axes[0][1] else "fraction")
        a.set_ylim(0, 1.02)
        a.grid(alpha=0.3)
        if a.lines:
            a.legend(loc="lower right", fontsize=8)

    ax = axes[1][1]
    ts = result.get("timeseries") or {}
    t = ts.get("t_s", [])
    if t:
        ax.plot(t, ts["output_tokens_per_s"], label="output tok/s")
        ax.set_ylabel("output tokens/s")
        ax2 = ax.twinx()
        ax2.plot(t, ts["requests_per_s"], color="tab:orange", alpha=0.7, label="finished req/s")
        ax2.set_ylabel("requests/s")
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax.set_title(f"Throughput over time (mean {m.get('output_throughput', 0):.1f} tok/s)")
    ax.set_xlabel("s since start")
    ax.grid(alpha=0.3)

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m pagedserve.loadtest.plot RESULT.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        plot_result(orjson.loads(f.read()), argv[1])
    print(f"plot saved to {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
