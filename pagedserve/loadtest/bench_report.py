"""The output of `bench serve`: the vllm-style table of one run, saved results read back (ours or
vLLM's) and two of them side by side (--compare).
"""
from __future__ import annotations

import orjson


_ROWS: list[tuple[str, str, str]] = [
    # (label, metric key, format)
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration_s", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Request goodput (req/s)", "request_goodput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".2f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".2f"),
]
_LAT = [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")]


def _table_lines(metrics_list: list[dict], names: list[str]) -> list[str]:
    """The vllm-style table; several runs side by side (ratio = last / first)."""
    multi = len(metrics_list) > 1
    width = 42
    col = 14

    def fmt(v, f):
        if v is None:
            return "-".rjust(col)
        return format(v, f).rjust(col) if f != "d" else str(int(v)).rjust(col)

    def row(label, key, f):
        vals = [m.get(key) for m in metrics_list]
        if all(v is None for v in vals):
            return None
        line = f"{label:<{width}}" + "".join(fmt(v, f) for v in vals)
        if multi:
            a, b = vals[0], vals[-1]
            ratio = f"{b / a:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "-"
            line += ratio.rjust(col)
        return line

    total = width + col * (len(metrics_list) + (1 if multi else 0))
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=total, c="=")]
    if multi:
        lines.append(" " * width + "".join(n[-col + 1:].rjust(col) for n in names) + "ratio".rjust(col))
    for label, key, f in _ROWS:
        r = row(label, key, f)
        if r:
            lines.append(r)
    for key, title in _LAT:
        lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=total, c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            r = row(f"{stat.capitalize()} {key.upper()} (ms)", f"{stat}_{key}_ms", ".2f")
            if r:
                lines.append(r)
    lines.append("=" * total)
    return lines


def format_table(result: dict) -> str:
    m = result["metrics"]
    lines = _table_lines([m], ["run"])
    extra = [f"model: {result['config'].get('model')}   endpoint: {result['config'].get('endpoint')}",
             f"tokenizer: {result.get('tokenizer')}"]
    if result.get("approximate_prompt_lengths"):
        extra.append("NOTE: prompt lengths are approximate (no tokenizer available)")
    if m.get("errors"):
        extra.append("errors: " + ", ".join(f"{k} x{v}" for k, v in m["errors"].items()))
    if m.get("requests_without_usage"):
        extra.append(f"WARNING: {m['requests_without_usage']} requests had no usage; their tokens are not counted")
    return "\n".join(lines + extra)


def load_result(path: str) -> dict:
    """A saved result: ours ({"metrics": {...}, ...}) or `vllm bench serve --save-result`'s flat
    file (figures at the top level, "duration" in seconds), so a vLLM run can be compared as is."""
    with open(path, "rb") as f:
        data = orjson.loads(f.read())
    if not isinstance(data, dict):
        raise ValueError("not a saved benchmark result (expected a JSON object)")
    if isinstance(data.get("metrics"), dict):
        return data
    if "completed" not in data:
        raise ValueError("not a saved benchmark result (no 'metrics' and no 'completed')")
    m = {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "duration" in m:
        m.setdefault("duration_s", m["duration"])
    if "failed" not in m and isinstance(data.get("num_prompts"), int):
        m["failed"] = data["num_prompts"] - data["completed"]
    return {"metrics": m, "config": {k: data.get(k) for k in ("model_id", "backend", "endpoint_type")}}


def format_compare(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    return "\n".join(_table_lines([a["metrics"], b["metrics"]], list(names)))
