"""nxdserve bench: metric definitions (vllm bench serve's), SSE request timing, /metrics parsing, reports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from nxdserve.bench.client import BenchClient, BenchError, Endpoint, RequestRecord, SamplingOptions, build_payload
from nxdserve.bench.datasets import SampleRequest
from nxdserve.bench.metrics import (
    calculate_metrics,
    parse_goodput,
    parse_percentiles,
    peak_concurrency,
    resolve_output_lens,
)
from nxdserve.bench.monitor import LoadSample, parse_load_gauges
from nxdserve.bench.report import format_table, result_to_json
from nxdserve.bench.runner import BenchConfig, BenchResult


def rec(
    start: float,
    ttft: float,
    itl: Sequence[float],
    latency: float,
    out_tokens: int | None,
    prompt_len: int = 10,
    success: bool = True,
    text: str = "",
) -> RequestRecord:
    r = RequestRecord(f"r{start}", prompt_len, 0)
    r.start_time, r.ttft, r.itl, r.latency = start, ttft, list(itl), latency
    r.chunk_times = list(start + ttft + np.concatenate([[0.0], np.cumsum(itl)]))
    r.output_tokens, r.success, r.generated_text = out_tokens, success, text
    if not success:
        r.error = "boom"
    return r


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        rec(10.0, 0.1, [0.02, 0.03, 0.05], 0.2, 4, prompt_len=7),  # TPOT (0.2-0.1)/3
        rec(10.5, 0.3, [], 0.3, 1, prompt_len=5),  # one token: no TPOT
        rec(10.6, 0.0, [], 0.1, None, prompt_len=100, success=False),
        rec(11.0, 0.2, [0.1, 0.1], 0.4, 3, prompt_len=8),  # TPOT 0.1
    ]


def test_latency_metrics_follow_vllm_definitions(records: list[RequestRecord]) -> None:
    lens = resolve_output_lens(records, None)
    assert lens == [4, 1, 0, 3]
    m = calculate_metrics(records, lens, duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 20, 8)

    ttft = m.stats["ttft"]
    assert ttft.mean == pytest.approx(200.0)
    assert ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx(float(np.std([100.0, 200.0, 300.0])))
    assert ttft.percentiles[99.0] == pytest.approx(298.0)  # linear interpolation between 200 and 300
    assert ttft.percentiles[50.0] == pytest.approx(200.0)

    tpot = m.stats["tpot"]  # only requests with more than one output token
    assert tpot.mean == pytest.approx((100.0 / 3 + 100.0) / 2)
    assert tpot.median == pytest.approx((100.0 / 3 + 100.0) / 2)

    itl = m.stats["itl"]  # pooled gaps of every request
    assert itl.mean == pytest.approx(np.mean([20, 30, 50, 100, 100]))
    assert itl.median == pytest.approx(50.0)

    e2el = m.stats["e2el"]
    assert e2el.mean == pytest.approx(300.0)
    assert e2el.percentiles[99.0] == pytest.approx(398.0)


def test_throughputs(records: list[RequestRecord]) -> None:
    m = calculate_metrics(records, resolve_output_lens(records, None), duration_s=2.0)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx((20 + 8) / 2.0)
    assert m.request_goodput is None
    # Chunks per one-second bucket from the earliest successful start (10.0): r1's 4 and r2's 1 land in
    # [10, 11), r4's 3 in [11, 12).
    assert m.max_output_tokens_per_s == 5.0
    assert m.max_concurrent_requests == 1


def test_goodput_counts_requests_meeting_every_slo(records: list[RequestRecord]) -> None:
    lens = resolve_output_lens(records, None)
    m = calculate_metrics(records, lens, 2.0, goodput_slos={"ttft": 250.0, "tpot": 50.0})
    assert m.request_goodput == pytest.approx(1 / 2.0)  # only r1: r2 misses TTFT, r4 misses TPOT
    # A one-token request has TPOT 0 for goodput, so it meets a TPOT-only SLO that the others miss.
    m = calculate_metrics(records, lens, 2.0, goodput_slos={"tpot": 1.0})
    assert m.request_goodput == pytest.approx(1 / 2.0)
    m = calculate_metrics(records, lens, 2.0, goodput_slos={"e2el": 300.0})
    assert m.request_goodput == pytest.approx(2 / 2.0)  # boundary is inclusive: 300 ms meets 300 ms


def test_empty_series_report_zero_not_nan() -> None:
    only_failed = [rec(0.0, 0.0, [], 0.1, None, success=False)]
    m = calculate_metrics(only_failed, [0], 1.0)
    assert m.completed == 0 and m.failed == 1
    assert all(st.mean == 0.0 and not math.isnan(st.median) for st in m.stats.values())
    assert m.max_output_tokens_per_s == 0.0 and m.max_concurrent_requests == 0


def test_peak_concurrency_uses_half_open_intervals() -> None:
    rs = [rec(0.0, 0.1, [], 1.0, 1), rec(1.0, 0.1, [], 1.0, 1), rec(0.5, 0.1, [], 1.0, 1), rec(0.6, 0.1, [], 0.1, 1)]
    # [0,1) [1,2) [0.5,1.5) [0.6,0.7): at 0.65 three are in flight; the touch at t=1 is not an overlap.
    assert peak_concurrency(rs) == 3
    assert peak_concurrency([rec(0.0, 0.1, [], 1.0, 1), rec(1.0, 0.1, [], 1.0, 1)]) == 1


def test_output_lens_prefer_usage_then_retokenize_then_chunks() -> None:
    rs = [
        rec(0.0, 0.1, [0.1], 0.2, 7, text="a b"),  # usage wins
        rec(0.0, 0.1, [0.1], 0.2, None, text="a b c"),  # re-tokenized
        rec(0.0, 0.1, [0.1, 0.1], 0.3, None, text=""),  # nothing to tokenize: count chunks
        rec(0.0, 0.1, [0.1], 0.2, 9, success=False),  # failed: 0
    ]
    assert resolve_output_lens(rs, lambda text: len(text.split())) == [7, 3, 3, 0]
    assert resolve_output_lens(rs, None) == [7, 2, 3, 0]


def test_percentile_keys_and_parsers() -> None:
    rs = [rec(0.0, 0.1, [0.1], 0.2, 2)]
    d = calculate_metrics(rs, [2], 1.0, percentiles=[90, 99.9]).to_dict()
    for key in ("mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p90_e2el_ms", "p99.9_ttft_ms"):
        assert key in d
    assert parse_percentiles("50,90,99") == [50.0, 90.0, 99.0]
    with pytest.raises(ValueError):
        parse_percentiles("0")
    assert parse_goodput(["ttft:200", "e2el:1500.5"]) == {"ttft": 200.0, "e2el": 1500.5}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["tpot:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


# -- request timing from SSE streams --------------------------------------------------------------------


def _sse(events: Sequence[dict[str, Any] | str]) -> bytes:
    out = b""
    for e in events:
        out += b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
    return out


@contextlib.asynccontextmanager
async def _client(
    body: bytes, status: int = 200, endpoint: Endpoint = "/v1/completions", pieces: int = 1
) -> AsyncIterator[BenchClient]:
    """A client against a real local HTTP server that answers every POST with ``body``, sent in ``pieces``
    writes (so that lines straddle network reads), after checking the request asks for a usage chunk."""

    async def handler(request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        if payload["stream"] is not True or payload["stream_options"] != {"include_usage": True}:
            return web.Response(status=422, text="not a streaming request with usage")
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        size = -(-len(body) // pieces)
        for i in range(0, len(body), size):
            await resp.write(body[i : i + size])
            await asyncio.sleep(0.005)  # separate network reads
        await resp.write_eof()
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post(endpoint, handler)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with BenchClient(f"http://127.0.0.1:{port}", endpoint) as client:
            yield client
    finally:
        await runner.cleanup()


@pytest.mark.anyio
async def test_completion_stream_timing_and_usage() -> None:
    body = _sse(
        [
            {"choices": [{"index": 0, "text": ""}]},  # a token whose text is held back: still a token
            {"choices": [{"index": 0, "text": "Hel"}]},
            {"choices": [{"index": 0, "text": "lo"}]},
            {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
            "[DONE]",
        ]
    )
    async with _client(body) as client:
        r = await client.send(SampleRequest("hi", 5, 3), "m", SamplingOptions())
    assert r.success and r.done and r.error == ""
    assert r.generated_text == "Hello!"
    assert r.output_tokens == 3 and r.server_prompt_tokens == 5
    assert r.ttft is not None and 0 <= r.ttft <= r.latency
    # As vllm bench serve counts them: every chunk with choices, the final usage chunk (no choices) not.
    assert len(r.itl) == 3 and len(r.chunk_times) == 4
    assert r.chunk_times[0] == pytest.approx(r.start_time + r.ttft)


@pytest.mark.anyio
async def test_stream_lines_split_across_reads_with_crlf_and_no_final_newline() -> None:
    events = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "bc", "d")]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events)
    body += b": a comment\n\ndata: " + json.dumps({"choices": [], "usage": {"completion_tokens": 3}}).encode()
    async with _client(body, pieces=7) as client:  # 7 writes: most lines are cut in two
        r = await client.send(SampleRequest("q", 1, 3), "m", SamplingOptions())
        assert await client.list_models() == [{"id": "m", "object": "model"}]
    assert r.success and r.generated_text == "abcd" and r.output_tokens == 3
    assert len(r.chunk_times) == 3 and len(r.itl) == 2
    assert r.itl == pytest.approx([b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)])


@pytest.mark.anyio
async def test_unreachable_server_is_a_bench_error_and_a_failed_request() -> None:
    async with BenchClient("http://127.0.0.1:1") as client:
        with pytest.raises(BenchError):
            await client.list_models()
        r = await client.send(SampleRequest("q", 1, 3), "m", SamplingOptions())
    assert not r.success and r.done and "Connect" in r.error


@pytest.mark.anyio
async def test_chat_stream_skips_role_chunk() -> None:
    body = _sse(
        [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Yes"}}]},
            "[DONE]",
        ]
    )
    async with _client(body, endpoint="/v1/chat/completions") as client:
        r = await client.send(SampleRequest("q", 1, 4), "m", SamplingOptions())
    assert r.success and r.generated_text == "Yes" and r.itl == [] and r.output_tokens is None


@pytest.mark.anyio
async def test_http_error_and_error_frame_fail_the_request() -> None:
    async with _client(b'{"error": {"message": "bad"}}', status=400) as client:
        r = await client.send(SampleRequest("q", 1, 4), "m", SamplingOptions())
    assert not r.success and "HTTP 400" in r.error
    body = _sse([{"choices": [{"text": "a"}]}, {"error": {"message": "engine died", "code": 500}}, "[DONE]"])
    async with _client(body) as client:
        r = await client.send(SampleRequest("q", 1, 4), "m", SamplingOptions())
    assert not r.success and r.error == "engine died"


def test_payloads() -> None:
    req = SampleRequest("p", 1, 17)
    comp = build_payload("/v1/completions", "m", req, SamplingOptions(ignore_eos=True, extra_body={"seed": 3}))
    assert comp["prompt"] == "p" and comp["max_tokens"] == 17 and comp["ignore_eos"] is True
    assert comp["temperature"] == 0.0 and comp["seed"] == 3
    chat = build_payload("/v1/chat/completions", "m", req, SamplingOptions())
    assert chat["messages"] == [{"role": "user", "content": "p"}] and chat["max_completion_tokens"] == 17
    assert "ignore_eos" not in chat


# -- /metrics parsing ----------------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""

LLAMACPP_METRICS = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_parse_load_gauges() -> None:
    assert parse_load_gauges(VLLM_METRICS) == (5.0, 7.0)  # summed over engines
    assert parse_load_gauges(LLAMACPP_METRICS) == (4.0, 1.0)
    assert parse_load_gauges("# TYPE other gauge\nother 1\n") == (None, None)
    assert parse_load_gauges("") == (None, None)


# -- reports -------------------------------------------------------------------------------------------


def _result(records: list[RequestRecord]) -> BenchResult:
    lens = resolve_output_lens(records, None)
    cfg = BenchConfig(max_concurrency=4, goodput={"ttft": 250.0})
    m = calculate_metrics(records, lens, 2.0, cfg.percentiles, cfg.goodput, cfg.metric_names)
    samples = [LoadSample(10.0, 1, 0), LoadSample(10.5, 2, 1), LoadSample(11.0, 1, None)]
    return BenchResult(cfg, "m", records, lens, m, 10.0, 2.0, samples)


def test_table_and_json(records: list[RequestRecord]) -> None:
    result = _result(records)
    table = format_table(result)
    assert "Serving Benchmark Result" in table
    for label in ("Successful requests:", "Request goodput (req/s):", "Mean TTFT (ms):", "P99 E2EL (ms):"):
        assert label in table
    data = result_to_json(result)
    json.dumps(data, allow_nan=False)  # standard JSON: inf request rate written as a string
    assert data["request_rate"] == "inf" and data["completed"] == 3 and data["failed"] == 1
    assert data["ttfts"][2] is None and data["errors"][2] == "boom"
    assert data["start_times"][0] == pytest.approx(0.0)
    assert data["server_load"]["running"] == [1, 2, 1]


def test_plots_written(records: list[RequestRecord], tmp_path: object) -> None:
    pytest.importorskip("matplotlib")
    from nxdserve.bench.plots import make_plots

    paths = make_plots(_result(records), str(tmp_path))
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == ["latency_cdf.png", "server_load.png", "tokens_per_second.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_skipped_without_matplotlib(
    records: list[RequestRecord], tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from nxdserve.bench import plots

    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    assert plots.make_plots(_result(records), str(tmp_path)) == []
    assert "matplotlib is not installed" in caplog.text
