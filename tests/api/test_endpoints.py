"""/v1/models, /health, /metrics, /version, /tokenize, /detokenize, /openapi.json."""

from __future__ import annotations

import importlib.metadata

import httpx
import pytest
from openai import AsyncOpenAI

import nxdserve
from tests.api.conftest import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.anyio

VLLM_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:iteration_tokens_total",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
]


async def test_models_list(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, "smol-alias"]
    card = (await http.get("/v1/models")).json()["data"][0]
    assert card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["root"] and card["owned_by"] and isinstance(card["created"], int)
    assert card["permission"][0]["object"] == "model_permission"


async def test_health_version_openapi(http: httpx.AsyncClient) -> None:
    health = await http.get("/health")
    assert health.status_code == 200 and health.content == b""
    # One source: the installed distribution's version (pyproject.toml), as nxdserve.__version__ reports it.
    served = (await http.get("/version")).json()["version"]
    assert served == nxdserve.__version__ == importlib.metadata.version("nxdserve")
    schema = (await http.get("/openapi.json")).json()
    assert schema["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(schema["paths"])
    assert "top_k" in schema["components"]["schemas"]["CompletionRequest"]["properties"]


def metric_samples(text: str, name: str) -> list[str]:
    """Sample lines of a metric (histograms included: _bucket, _count, _sum)."""
    heads = tuple(f"{name}{suffix}{{" for suffix in ("", "_bucket", "_count", "_sum"))
    return [line for line in text.splitlines() if line.startswith(heads)]


async def test_metrics_names_and_labels(http: httpx.AsyncClient) -> None:
    await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    text = (await http.get("/metrics")).text
    for name in VLLM_METRICS:
        samples = metric_samples(text, name)
        assert samples, name
        assert all(f'model_name="{MODEL_NAME}"' in line for line in samples), name
    success = metric_samples(text, "vllm:request_success_total")
    assert any('finished_reason="length"' in line for line in success)
    # every reason has a sample from the start (rate() reads 0, not "no data")
    for reason in ("stop", "abort", "error"):
        assert any(f'finished_reason="{reason}"' in line for line in success), reason


async def test_per_request_histograms_agree_with_the_request(http: httpx.AsyncClient) -> None:
    def value(text: str, sample: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + "{"))

    before = (await http.get("/metrics")).text
    r = await http.post("/v1/completions", json={"prompt": "Hello there, friend", "max_tokens": 5, "ignore_eos": True})
    usage = r.json()["usage"]
    after = (await http.get("/metrics")).text
    for name, expected in [("vllm:request_prompt_tokens_sum", usage["prompt_tokens"]),
                           ("vllm:request_generation_tokens_sum", 5), ("vllm:request_prompt_tokens_count", 1),
                           ("vllm:request_time_per_output_token_seconds_count", 1),
                           ("vllm:prompt_tokens_total", usage["prompt_tokens"])]:
        assert value(after, name) - value(before, name) == expected, name
    tpot = value(after, "vllm:request_time_per_output_token_seconds_sum") - value(
        before, "vllm:request_time_per_output_token_seconds_sum")
    decode = value(after, "vllm:request_decode_time_seconds_sum") - value(
        before, "vllm:request_decode_time_seconds_sum")
    assert tpot > 0 and abs(tpot * 4 - decode) < 1e-6  # the mean over the 4 gaps between 5 tokens


async def test_tokenize_detokenize_roundtrip(http: httpx.AsyncClient) -> None:
    r = (await http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    back = (await http.post("/detokenize", json={"tokens": r["tokens"]})).json()
    assert back["prompt"].endswith("Hello world")
    chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    assert chat["count"] > r["count"]
    assert chat["token_strs"] is None
