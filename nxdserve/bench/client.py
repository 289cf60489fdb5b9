"""Streaming OpenAI-compatible client: one request in, one timed ``RequestRecord`` out.

Timing follows ``vllm bench serve``: ``ttft`` runs from just before the request is sent to the first SSE
chunk that carries text, ``itl`` holds the gaps between later text chunks, ``latency`` ends when the stream
closes. Times are ``time.perf_counter()`` seconds.

Requests go through aiohttp, as ``vllm bench serve``'s do. The load generator shares the machine with the
server it measures, so its own CPU time is taken from the server: streaming workload a (4,096 SSE chunks)
cost this client 0.73-0.80 CPU-seconds on httpx and 0.30-0.31 on aiohttp, and the server under test ran
that much faster (measured against nxdserve, 3 interleaved runs each).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import httpx

from nxdserve.bench.datasets import SampleRequest

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[Endpoint, ...] = ("/v1/completions", "/v1/chat/completions")


class BenchError(RuntimeError):
    """A benchmark that cannot go on (server unreachable, warm-up failed, no model)."""


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    expected_output_len: int
    group: str = ""
    start_time: float = 0.0  # perf_counter when the request was sent
    ttft: float | None = None  # None until the first token's chunk arrives (callers may watch it live)
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of every token chunk
    latency: float = 0.0
    generated_text: str = ""
    output_tokens: int | None = None  # from the server's usage, when it reports one
    server_prompt_tokens: int | None = None
    success: bool = False
    error: str = ""
    done: bool = False

    @property
    def end_time(self) -> float:
        return self.start_time + self.latency


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class SamplingOptions:
    temperature: float = 0.0  # greedy unless asked otherwise, as vllm bench serve
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(endpoint: Endpoint, model: str, req: SampleRequest, sampling: SamplingOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "temperature": sampling.temperature,
        "stream": True,
        # Ask for the token count; without it the output is re-tokenized, which can miscount.
        "stream_options": {"include_usage": True},
    }
    if endpoint == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        # max_completion_tokens is the current name; max_tokens is what older servers (llama.cpp) read.
        payload["max_completion_tokens"] = req.expected_output_len
        payload["max_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    if sampling.top_p is not None:
        payload["top_p"] = sampling.top_p
    if sampling.top_k is not None:
        payload["top_k"] = sampling.top_k
    if sampling.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(sampling.extra_body)
    return payload


def _carries_tokens(endpoint: Endpoint, choices: list[dict[str, Any]]) -> bool:
    """Whether a chunk marks generated tokens, as ``vllm bench serve`` counts them: any chunk with choices,
    even with empty text (a server sends one for tokens whose text it holds back, such as the first half of
    a UTF-8 character), except a chat chunk that only announces the assistant's role."""
    if not choices:
        return False
    if endpoint == "/v1/chat/completions":
        return any(not (choice.get("delta") or {}).get("role") or _chunk_text(endpoint, [choice]) for choice in choices)
    return True


def _chunk_text(endpoint: Endpoint, choices: list[dict[str, Any]]) -> str:
    parts: list[str] = []
    for choice in choices:
        if endpoint == "/v1/chat/completions":
            delta = choice.get("delta") or {}
            # Reasoning models stream their thinking first; it is generated output all the same.
            parts.append(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def _error_message(obj: dict[str, Any]) -> str:
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err if err is not None else obj.get("message", obj))


def _take_line(endpoint: Endpoint, rec: RequestRecord, line: bytes) -> None:
    """One SSE line of a streamed response into ``rec``."""
    if not line.startswith(b"data:"):
        return  # blank separators, SSE comments, event: lines
    data = line[5:].strip()
    if data == b"[DONE]":
        return  # keep reading to the real end of the stream: that ends the latency
    now = time.perf_counter()
    obj = json.loads(data)
    if "error" in obj and not obj.get("choices"):
        rec.error = _error_message(obj)
        return
    choices = obj.get("choices") or []
    if _carries_tokens(endpoint, choices):
        if rec.ttft is None:
            rec.ttft = now - rec.start_time
        else:
            rec.itl.append(now - rec.chunk_times[-1])
        rec.chunk_times.append(now)
        rec.generated_text += _chunk_text(endpoint, choices)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        rec.server_prompt_tokens = usage.get("prompt_tokens", rec.server_prompt_tokens)


class BenchClient:
    """One pooled ``aiohttp.ClientSession`` for every request of a run (pool sized to the concurrency)."""

    def __init__(
        self,
        base_url: str,
        endpoint: Endpoint = "/v1/completions",
        api_key: str | None = None,
        max_connections: int = 100,
        timeout_s: float = 6 * 3600.0,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.endpoint: Endpoint = endpoint
        self.headers = auth_headers(api_key)
        self.max_connections = max_connections
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30.0)
        self._session: aiohttp.ClientSession | None = None  # made in the running loop, on first use

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # trust_env=False: a proxy variable in the environment must never reroute benchmark traffic.
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self.headers, timeout=self.timeout, trust_env=False
            )
        return self._session

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def list_models(self) -> list[dict[str, Any]]:
        url = f"{self.base_url}/v1/models"
        try:
            async with self._http().get(url) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise BenchError(f"GET /v1/models returned HTTP {resp.status}: {body[:300]}")
                data = json.loads(body).get("data") or []
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            raise BenchError(f"cannot reach {url}: {exc!r}") from exc
        return [m for m in data if isinstance(m, dict)]

    async def send(
        self, req: SampleRequest, model: str, sampling: SamplingOptions, record: RequestRecord | None = None
    ) -> RequestRecord:
        """Stream one request, filling ``record`` as chunks arrive (so a caller can watch ``ttft``)."""
        rec = record or RequestRecord(req.request_id, req.prompt_len, req.expected_output_len, req.group)
        payload = build_payload(self.endpoint, model, req, sampling)
        rec.start_time = time.perf_counter()
        try:
            async with self._http().post(self.base_url + self.endpoint, json=payload) as resp:
                if resp.status != 200:
                    body = (await resp.read()).decode("utf-8", "replace")
                    rec.error = f"HTTP {resp.status}: {body[:500]}"
                else:
                    # Lines split here rather than by the reader, which caps a line's length.
                    pending = b""
                    async for chunk in resp.content.iter_any():
                        *lines, pending = (pending + chunk).split(b"\n")
                        for line in lines:
                            _take_line(self.endpoint, rec, line)
                    _take_line(self.endpoint, rec, pending)  # a last line with no newline
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.latency = time.perf_counter() - rec.start_time
        rec.success = not rec.error
        if rec.success and rec.ttft is None:
            # A stream with no text (e.g. EOS first) has its first and last token at the end.
            rec.ttft = rec.latency
        rec.done = True
        return rec


def wait_for_server(base_url: str, timeout_s: float = 600.0, poll_s: float = 0.5, alive: Any = None) -> None:
    """Block until GET /health answers 200. ``alive()`` (e.g. a process poll) returning False aborts early."""
    deadline = time.monotonic() + timeout_s
    last_err = "no answer"
    with httpx.Client(base_url=base_url, timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise BenchError(f"server at {base_url} exited before it became healthy")
            try:
                resp = client.get("/health")
                if resp.status_code == 200:
                    return
                last_err = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last_err = repr(exc)
            time.sleep(poll_s)
    raise BenchError(f"server at {base_url} not healthy after {timeout_s:.0f}s ({last_err})")
