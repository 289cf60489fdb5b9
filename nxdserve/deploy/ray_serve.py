"""Ray Serve: nxdserve engines as Serve replicas behind an OpenAI-compatible ingress (``pip install nxdserve[ray]``).

    serve run nxdserve.deploy.ray_serve:build_app max_num_seqs=8 num_replicas=2
    serve run deploy/ray/serve-config.yaml

Three deployments, all Ray Serve's own machinery:
- ``OpenAIIngress`` takes every HTTP request and passes it, as a ForwardedRequest, to an engine replica through
  a streaming DeploymentHandle, so Ray's request router picks the replica: power of two choices on ongoing
  requests by default, or ray.serve.llm's PrefixCacheAffinityRouter (``prefix_aware=true``), which reads the
  request's ``prompt`` / ``messages`` so a conversation's turns land where their prefix is cached.
- ``NxdServeEngine`` replicas each run an AsyncEngine and nxdserve's own Starlette app (forwarding.play), so
  routes, errors and streaming are the ones ``nxdserve`` serves. Serve health-checks them (``check_health``),
  restarts dead ones and autoscales them on ongoing requests (``autoscaling_config``).
- ``MetricsHub`` (one replica) keeps each engine replica's latest vLLM-named exposition; the ingress's /metrics
  answers all of them, each series labelled ``replica``.
If a replica dies mid-stream, the ingress ends the stream with an OpenAI error frame and [DONE] (or answers a 503
before any byte was sent); the router stops choosing the dead replica and the controller starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from nxdserve.api.errors import APIError
from nxdserve.config import EngineConfig
from nxdserve.deploy.forwarding import ForwardedRequest, play
from nxdserve.engine.dp.metrics import labelled_families

logger = logging.getLogger(__name__)

PREFIX_AWARE_ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
# The same class where it is defined. Ray 2.60's public module above imports Ray Serve LLM's protocol models,
# which need vLLM or SGLang installed; the defining module needs neither.
_PREFIX_AWARE_ROUTER_IMPL = ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
                             "PrefixCacheAffinityRouter")
_METRICS_PUSH_INTERVAL_S = 1.0
_METRICS_STALE_S = 15.0  # a replica that stopped reporting (dead) drops out of /metrics after this


@serve.deployment(name="MetricsHub", num_replicas=1, ray_actor_options={"num_cpus": 0})
class MetricsHub:
    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, str]] = {}

    def report(self, replica: str, text: str) -> None:
        self._latest[replica] = (time.monotonic(), text)

    def collect(self) -> dict[str, str]:
        cutoff = time.monotonic() - _METRICS_STALE_S
        self._latest = {k: v for k, v in self._latest.items() if v[0] >= cutoff}
        return {replica: text for replica, (_, text) in self._latest.items()}


@serve.deployment(name="NxdServeEngine")
class NxdServeEngine:
    # Ray Serve awaits an async __init__; mypy's rule that __init__ returns None does not know that.
    async def __init__(  # type: ignore[misc]
        self, engine_config: dict[str, Any], metrics_hub: DeploymentHandle | None = None,
        api_key: str | None = None, drain_timeout_s: float = 30.0,
    ) -> None:
        from nxdserve.api.app import create_app
        from nxdserve.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(EngineConfig(**engine_config))
        await self.engine.start()
        self.app = create_app(self.engine, None, api_key)
        self.drain_timeout_s = drain_timeout_s
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._hub = metrics_hub
        self._pusher = asyncio.create_task(self._push_metrics()) if metrics_hub is not None else None

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        """The app's response to one forwarded request: (status, headers), then body chunks."""
        async for event in play(self.app, request):
            yield event

    def exposition(self) -> str:
        from prometheus_client import generate_latest

        stats = self.engine.stats()
        self.engine.metrics.record_step(stats.num_running, stats.num_waiting, stats.kv_cache_usage, 0, 0)
        return generate_latest(self.engine.metrics.registry).decode()

    async def _push_metrics(self) -> None:
        assert self._hub is not None
        while True:
            with contextlib.suppress(Exception):  # a hub restart costs a few seconds of metrics, nothing more
                await self._hub.report.remote(self.replica, self.exposition())
            await asyncio.sleep(_METRICS_PUSH_INTERVAL_S)

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and Serve replaces it."""
        if not self.engine.is_healthy:
            raise RuntimeError(f"the engine loop is dead: {self.engine.dead_error}")

    async def __del__(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
        await self.engine.shutdown(drain_timeout=self.drain_timeout_s)


def _error_response(message: str, status: int = 503) -> Response:
    error = APIError(message, status=status)
    return Response(content=error.response().body, status_code=status, media_type="application/json")


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, metrics_hub: DeploymentHandle) -> None:
        self.engine = engine.options(stream=True, method_name="handle")
        self.hub = metrics_hub

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/metrics":
            return await self._metrics()
        body = await request.body()
        forwarded = ForwardedRequest.build(request.method, request.url.path, request.url.query.encode(),
                                           list(request.headers.raw), body)
        events = self.engine.remote(forwarded)
        assert isinstance(events, DeploymentResponseGenerator)  # the handle has stream=True
        try:
            start = await events.__anext__()
        except Exception as exc:  # the replica died (or never answered) before a byte was sent
            logger.warning("engine replica failed before responding: %s", exc)
            return _error_response(f"The engine replica failed: {type(exc).__name__}; retry the request.")
        status, headers = start
        response = StreamingResponse(self._body(events, headers), status_code=status)
        response.raw_headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        return response

    async def _body(self, events: Any, headers: list[tuple[bytes, bytes]]) -> AsyncIterator[bytes]:
        streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        try:
            async for chunk in events:
                yield chunk
        except Exception as exc:  # the replica died mid-response
            logger.warning("engine replica failed mid-response: %s", exc)
            if streaming:  # the client sees an OpenAI error frame and the end of the stream
                error = APIError(f"The engine replica serving this stream failed: {type(exc).__name__}",
                                 status=503)
                import json

                yield f"data: {json.dumps(error.body())}\n\n".encode()
                yield b"data: [DONE]\n\n"
            else:
                raise

    async def _metrics(self) -> Response:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.registry import Collector

        expositions = await self.hub.collect.remote()
        families = labelled_families(expositions, "replica")

        class _Snapshot(Collector):
            def collect(self) -> Any:
                return iter(families)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot())
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")


_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def build_app(args: dict[str, Any]) -> Any:
    """``serve run`` entry point. ``args``: EngineConfig fields (model, max_num_seqs, max_model_len, backend,
    tensor_parallel_size, ...) plus num_replicas (or autoscaling min_replicas / max_replicas /
    target_ongoing_requests), num_cpus and neuron_cores per replica, prefix_aware, api_key, drain_timeout_s.
    An unknown key is an error, never ignored."""
    args = dict(args)
    replica_keys = {"num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "num_cpus",
                    "neuron_cores", "prefix_aware", "api_key", "drain_timeout_s", "max_ongoing_requests"}
    unknown = set(args) - _ENGINE_FIELDS - replica_keys
    if unknown:
        raise ValueError(f"unknown nxdserve Ray Serve arguments: {sorted(unknown)}; EngineConfig fields and "
                         f"{sorted(replica_keys)} are accepted")
    engine_config = {k: _coerce(k, v) for k, v in args.items() if k in _ENGINE_FIELDS}
    max_num_seqs = int(engine_config.get("max_num_seqs", EngineConfig.max_num_seqs))
    options: dict[str, Any] = {
        # Enough for a full batch plus as many waiting: the engine's own scheduler does the queueing.
        "max_ongoing_requests": int(args.get("max_ongoing_requests", 2 * max_num_seqs)),
        "ray_actor_options": _actor_options(args),
        "graceful_shutdown_timeout_s": float(args.get("drain_timeout_s", 30.0)) + 5.0,
    }
    if "min_replicas" in args or "max_replicas" in args:
        options["autoscaling_config"] = {
            "min_replicas": int(args.get("min_replicas", 1)),
            "max_replicas": int(args.get("max_replicas", 1)),
            # Scale on queue length: more replicas once a replica holds more than a full batch.
            "target_ongoing_requests": float(args.get("target_ongoing_requests", max_num_seqs)),
        }
    else:
        options["num_replicas"] = int(args.get("num_replicas", 1))
    if _truthy(args.get("prefix_aware", False)):
        options["request_router_config"] = {"request_router_class": prefix_aware_router()}
    # ray's stubs type @serve.deployment as returning the class itself, not the Deployment it makes.
    hub = MetricsHub.bind()  # type: ignore[attr-defined]
    engine_options = NxdServeEngine.options(**options)  # type: ignore[attr-defined]
    engine = engine_options.bind(engine_config, hub, args.get("api_key"),
                                                    float(args.get("drain_timeout_s", 30.0)))
    return OpenAIIngress.bind(engine, hub)  # type: ignore[attr-defined]


def prefix_aware_router() -> str:
    """The import path of Ray's PrefixCacheAffinityRouter that this installation can load."""
    try:
        import ray.serve.llm.request_router
    except ImportError:
        import ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router  # noqa: F401

        return _PREFIX_AWARE_ROUTER_IMPL
    return PREFIX_AWARE_ROUTER


def _actor_options(args: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": float(args.get("num_cpus", 1))}
    if "neuron_cores" in args:  # Ray sets NEURON_RT_VISIBLE_CORES for the replica's actor
        options["resources"] = {"neuron_cores": int(args["neuron_cores"])}
    return options


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


def _coerce(name: str, value: Any) -> Any:
    """``serve run``'s key=value arguments arrive as strings: give them EngineConfig's types."""
    if not isinstance(value, str):
        return value
    if name == "served_model_name":
        return [n for n in value.split(",") if n]
    default = getattr(EngineConfig, name, None)
    if isinstance(default, bool):
        return _truthy(value)
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    if value.isdigit():
        return int(value)
    return value
