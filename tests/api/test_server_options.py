"""Real servers started from ``vllm serve``-style command lines: TLS through the openai SDK with a
certificate made in the test (trustme), CORS preflight and simple requests, --root-path, --middleware,
several API keys and served names; and KV sizing from VLLM_CPU_KVCACHE_SPACE with
--override-generation-config on a tiny model."""

from __future__ import annotations

import json
import shlex
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from openai import AsyncOpenAI

from nxdserve import cli
from nxdserve.api.server import BackgroundServer
from tests.helpers.tiny_model import tiny_model_path

pytestmark = pytest.mark.anyio

ORIGIN = "https://app.example"
SLOT_BYTES = 2 * 2 * 2 * 256 * 16 * 4  # the tiny model's KV for one 256-token sequence in fp32


def start(command: str) -> BackgroundServer:
    config, opts, _ = cli.plan(shlex.split(command))
    return BackgroundServer(config, opts).start()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_server(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    folder = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(folder / "cert.pem"), append=True)
    server = start(
        f"--model {tiny_model_path('llama')} --backend torch --device cpu --dtype float32 --max-model-len 256 "
        "--max-num-seqs 2 --host 127.0.0.1 --port 0 --log-level warning "
        f"--ssl-keyfile {folder / 'key.pem'} --ssl-certfile {folder / 'cert.pem'} "
        f"--allowed-origins '[\"{ORIGIN}\"]' --allowed-methods '[\"GET\", \"POST\"]' "
        "--root-path /llm --served-model-name smol other --api-key first-key second-key "
        "--middleware tests.api.user_middleware.TagResponses --middleware tests.api.user_middleware.stamp_path"
    )
    yield server
    server.stop()


def _ssl_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def test_openai_sdk_over_https(tls_server: BackgroundServer, ca: trustme.CA) -> None:
    assert tls_server.url.startswith("https://")
    async with httpx.AsyncClient(verify=_ssl_context(ca)) as http_client:
        client = AsyncOpenAI(base_url=f"{tls_server.url}/v1", api_key="second-key", http_client=http_client)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["smol", "other"]
        chat = await client.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert chat.model == "smol" and chat.usage is not None and chat.usage.completion_tokens <= 3
        resp = await client.responses.create(model="smol", input="Hi", max_output_tokens=3, temperature=0)
        assert resp.output_text == chat.choices[0].message.content


async def test_plain_http_to_the_tls_port_fails(tls_server: BackgroundServer) -> None:
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.HTTPError):
            await http.get(tls_server.url.replace("https://", "http://") + "/health")


async def test_untrusted_certificate_is_rejected(tls_server: BackgroundServer) -> None:
    async with httpx.AsyncClient() as http:  # the system CAs do not know the test CA
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{tls_server.url}/health")


async def test_cors_preflight_and_simple_request(tls_server: BackgroundServer, ca: trustme.CA) -> None:
    async with httpx.AsyncClient(base_url=tls_server.url, verify=_ssl_context(ca)) as http:
        preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
        r = await http.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        denied = await http.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers
        put = await http.options("/v1/models", headers={**preflight, "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400
        r = await http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer first-key"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        # A refused key still carries the CORS header, so a browser shows the 401, not a CORS error.
        r = await http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


async def test_root_path_middleware_and_keys(tls_server: BackgroundServer, ca: trustme.CA) -> None:
    async with httpx.AsyncClient(base_url=tls_server.url, verify=_ssl_context(ca)) as http:
        # Behind a proxy that strips /llm: the routes answer at /v1/..., and the API key still guards them.
        assert (await http.get("/v1/models")).status_code == 401
        r = await http.get("/v1/models", headers={"Authorization": "Bearer second-key"})
        assert r.status_code == 200
        assert r.headers["x-user-middleware"] == "class"  # the class middleware
        assert r.headers["x-seen-path"] == "/llm/v1/models"  # the function middleware sees the full path
        health = await http.get("/health")
        assert health.status_code == 200 and health.headers["x-user-middleware"] == "class"
        spec = (await http.get("/openapi.json")).json()
        assert set(spec["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}


@pytest.fixture(scope="module")
def sized_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """A tiny model (2 layers x K and V x 2 KV heads x 16 dims, fp32: 128 KiB per 256-token sequence) given
    KV space for 3.5 sequences through VLLM_CPU_KVCACHE_SPACE, and greedy 5-token defaults by override;
    served on a Unix socket (--uds)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", str(3.5 * SLOT_BYTES / 2**30))
        server = start(
            f"--model {tiny_model_path('llama')} --backend torch --device cpu --dtype float32 --max-model-len 256 "
            f"--max-num-seqs 8 --uds {tmp_path_factory.mktemp('uds') / 'nxdserve.sock'} --log-level warning "
            "--override-generation-config '{\"temperature\": 0, \"max_new_tokens\": 5}'"
        )
    yield server
    server.stop()


async def test_kv_space_sets_the_slots_and_overrides_set_defaults(sized_server: BackgroundServer) -> None:
    assert sized_server.engine.config.max_num_seqs == 3
    assert sized_server.engine.core.backend.runner.kv_cache.nbytes == 3 * SLOT_BYTES  # what was allocated
    assert sized_server.engine.generation_defaults == {"temperature": 0, "max_tokens": 5}
    transport = httpx.AsyncHTTPTransport(uds=sized_server.opts.uds)
    async with httpx.AsyncClient(transport=transport) as http_client:
        client = AsyncOpenAI(base_url="http://nxdserve/v1", api_key="none", max_retries=0, http_client=http_client)
        chats = [
            await client.chat.completions.create(
                model=sized_server.engine.config.model,
                messages=[{"role": "user", "content": "Hello there"}],
                extra_body={"ignore_eos": True},
            )
            for _ in range(2)
        ]
        assert [c.usage.completion_tokens for c in chats] == [5, 5]  # type: ignore[union-attr]
        assert chats[0].choices[0].message.content == chats[1].choices[0].message.content  # greedy by default
        resp = await client.responses.create(model=sized_server.engine.config.model, input="Hello there")
        assert resp.status == "incomplete" and resp.usage is not None and resp.usage.output_tokens <= 5
        assert resp.temperature == 0


def test_config_file_and_flags_on_top(tmp_path: Path) -> None:
    """docs.vllm.ai, Configuration > serve args: ``vllm serve --config config.yaml``; the command line wins."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        "model: /tmp/model\nhost: 127.0.0.1\nport: 6379\nuvicorn-log-level: info\nmax_num_seqs: 4\n"
        "enforce_eager: true\nallowed-origins: '[\"https://a.example\"]'\n"
        f"override-generation-config: {json.dumps({'top_p': 0.9})}\n"
    )
    cfg, opts, infos = cli.plan(["--config", str(config_file), "--port", "7000"])
    assert (cfg.model, cfg.max_num_seqs, cfg.override_generation_config) == ("/tmp/model", 4, {"top_p": 0.9})
    assert (opts.host, opts.port, opts.uvicorn_log_level) == ("127.0.0.1", 7000, "info")
    assert opts.allowed_origins == ["https://a.example"]
    assert [line.split()[0] for line in infos] == ["--enforce-eager"]


def test_config_file_false_values(tmp_path: Path) -> None:
    """``false`` turns a flag with a --no- form off, and leaves a plain switch at its default (vLLM skips it)."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text("enable-auto-tool-choice: false\ncpu-quant-int8-activations: false\n"
                           "enable-chunked-prefill: false\nenable-prefix-caching: false\n")
    cfg, _, _ = cli.plan(["--config", str(config_file), "--model", "/tmp/model"])
    assert not cfg.enable_auto_tool_choice and cfg.scheduling_mode == "prefill-first"
    assert not cfg.enable_prefix_caching
