"""The result table (laid out like ``vllm bench serve``'s) and the result JSON."""

from __future__ import annotations

import json
import math
import os
from datetime import datetime
from typing import Any

from nxdserve.bench.metrics import METRIC_TITLES, percentile_label
from nxdserve.bench.runner import BenchResult

_WIDTH = 50


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^{_WIDTH}}"


def _row(label: str, value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def format_table(result: BenchResult) -> str:
    m = result.metrics
    cfg = result.config
    lines = [_title(" Serving Benchmark Result ", "=")]
    lines.append(_row("Successful requests:", m.completed))
    lines.append(_row("Failed requests:", m.failed))
    if cfg.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", cfg.max_concurrency))
    lines.append(_row("Request rate configured (RPS):", cfg.request_rate))
    lines.append(_row("Benchmark duration (s):", m.duration_s))
    lines.append(_row("Total input tokens:", m.total_input))
    lines.append(_row("Total generated tokens:", m.total_output))
    lines.append(_row("Request throughput (req/s):", m.request_throughput))
    if m.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", m.request_goodput))
    lines.append(_row("Output token throughput (tok/s):", m.output_throughput))
    lines.append(_row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s))
    lines.append(_row("Peak concurrent requests:", m.max_concurrent_requests))
    lines.append(_row("Total token throughput (tok/s):", m.total_token_throughput))
    for name, st in m.stats.items():
        short = name.upper()
        lines.append(_title(METRIC_TITLES[name], "-"))
        lines.append(_row(f"Mean {short} (ms):", st.mean))
        lines.append(_row(f"Median {short} (ms):", st.median))
        lines.append(_row(f"Std {short} (ms):", st.std))
        for p, v in st.percentiles.items():
            lines.append(_row(f"P{percentile_label(p)} {short} (ms):", v))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings so the file stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def result_to_json(result: BenchResult, save_detailed: bool = False) -> dict[str, Any]:
    cfg = result.config
    recs = result.records
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": cfg.base_url,
        "endpoint_type": cfg.endpoint,
        "model_id": result.model,
        "tokenizer_id": result.tokenizer_name,
        "num_prompts": len(recs),
        "request_rate": cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "ignore_eos": cfg.sampling.ignore_eos,
        "temperature": cfg.sampling.temperature,
        "goodput_slos_ms": cfg.goodput or None,
        "percentiles": cfg.percentiles,
    }
    out.update(result.metrics.to_dict())
    # Per-request arrays, aligned by index, in seconds (vLLM's layout).
    out.update(
        {
            "request_ids": [r.request_id for r in recs],
            "groups": [r.group for r in recs],
            "input_lens": [r.prompt_len for r in recs],
            "output_lens": result.output_lens,
            "start_times": [r.start_time - result.start_time for r in recs],
            "ttfts": [r.ttft if r.success else None for r in recs],
            "itls": [r.itl for r in recs],
            "e2els": [r.latency if r.success else None for r in recs],
            "errors": [r.error for r in recs],
        }
    )
    out["server_load"] = {
        "note": result.load_note,
        "times": [s.time - result.start_time for s in result.load_samples],
        "running": [s.running for s in result.load_samples],
        "waiting": [s.waiting for s in result.load_samples],
    }
    if save_detailed:
        out["generated_texts"] = [r.generated_text for r in recs]
    out.update(result.extra)
    safe: dict[str, Any] = _json_safe(out)
    return safe


def default_result_path() -> str:
    return os.path.join("bench-results", datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")


def write_json(data: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
