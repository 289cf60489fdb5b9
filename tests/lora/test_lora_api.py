"""LoRA over the OpenAI API and the embedded AsyncEngine, on both backends (nxd through the emulator): adapters
chosen by model name, listed with their parent, 404 for unknown names, run-time load/unload behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING. On nxd an adapter that was not compiled in (not in --lora-modules) is a 400
naming it; a compiled-in one can be unloaded and loaded again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import httpx
import openai
import pytest

from nxdserve.api.server import BackgroundServer, ServeOptions
from nxdserve.config import EngineConfig
from nxdserve.engine.async_engine import AsyncEngine
from nxdserve.errors import LoRAAdapterError, LoRANotFoundError
from nxdserve.lora.request import LoRARequest
from nxdserve.sampling_params import SamplingParams
from tests.helpers.lora import greedy_reference, make_peft_adapter, peft_reference
from tests.helpers.tiny_model import tiny_model_path

pytestmark = pytest.mark.anyio
PROMPT = [1, 450, 7483, 310, 3444, 338]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base, root = tiny_model_path("llama"), tmp_path_factory.mktemp("api-adapters")
    return {name: make_peft_adapter(base, root / name, seed=seed) for seed, name in enumerate(["a1", "a2", "a3"])}


NOT_COMPILED = "not compiled into the NxD model"


def _config(**overrides: object) -> EngineConfig:
    settings: dict = {"model": str(tiny_model_path("llama")), "backend": "torch", "dtype": "float32",
                      "max_model_len": 128, "max_num_seqs": 4, "served_model_name": ["base"], "enable_lora": True,
                      "max_loras": 2, "num_threads": 1}
    settings.update(overrides)
    return EngineConfig(**settings)


@pytest.fixture(scope="module")
def server(backend: str, adapters: dict[str, Path]) -> Iterator[BackgroundServer]:
    """--lora-modules a1 (and on nxd a2, which NxD must compile in to load it at run time)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    modules = [LoRARequest("a1", 1, str(adapters["a1"]), base_model_name="tiny-llama")]
    if backend == "nxd":
        modules.append(LoRARequest("a2", 2, str(adapters["a2"])))
    opts = ServeOptions(host="127.0.0.1", port=0, log_level="warning", drain_timeout=5.0)
    srv = BackgroundServer(_config(backend=backend, lora_modules=modules), opts).start()
    yield srv
    srv.stop()
    mp.undo()


def _client(server: BackgroundServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


async def _complete(client: openai.AsyncOpenAI, model: str) -> str:
    out = await client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
    return out.choices[0].text


@cache
def _reference_text(adapter: Path | None) -> str:
    from transformers import AutoTokenizer

    base = tiny_model_path("llama")
    tokens = greedy_reference(peft_reference(base, adapter), PROMPT, MAX_TOKENS)
    return str(AutoTokenizer.from_pretrained(str(base)).decode(tokens))


async def test_sdk_selects_adapters_by_model_name(server: BackgroundServer, adapters: dict[str, Path]) -> None:
    async with _client(server) as client:
        models = {m.id: m for m in (await client.models.list()).data}
        assert models["base"].parent is None and models["a1"].parent == "tiny-llama"
        assert models["a1"].root == str(adapters["a1"])
        assert await _complete(client, "a1") == _reference_text(adapters["a1"])
        assert await _complete(client, "base") == _reference_text(None)
        with pytest.raises(openai.NotFoundError) as info:
            await _complete(client, "nope")
        assert info.value.body["param"] == "model"  # type: ignore[index]


async def test_runtime_load_use_unload(backend: str, server: BackgroundServer, adapters: dict[str, Path]) -> None:
    nxd = backend == "nxd"
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, _client(server) as client:
        if nxd:  # a2 is compiled in and served from start-up: unloaded first, then loaded again below
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})).status_code == 200
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully."
        dup = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
        assert dup.status_code == 400 and dup.json()["error"]["param"] == "lora_name"
        missing = await http.post("/v1/load_lora_adapter", json={"lora_name": "a9"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "a9", "lora_path": "/nonexistent"})
        assert bad.status_code == 400
        assert (NOT_COMPILED if nxd else "adapter_config.json") in bad.json()["error"]["message"]
        ids = {m.id: m.parent for m in (await client.models.list()).data}
        assert ids["a2"] == "base"  # no base_model_name given: the first served name
        a2 = await _complete(client, "a2")
        assert a2 == _reference_text(adapters["a2"]) and a2 != await _complete(client, "a1")
        wrong = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2", "lora_int_id": 99})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "lora_int_id"
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError):
            await _complete(client, "a2")
        again = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"
        # A valid adapter NxD did not compile in; on torch it loads like any other.
        a3 = await http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapters["a3"])})
        if nxd:
            assert a3.status_code == 400 and a3.json()["error"]["param"] == "lora_name"
            assert NOT_COMPILED in a3.json()["error"]["message"]
            with pytest.raises(openai.NotFoundError):
                await _complete(client, "a3")
        else:
            assert a3.status_code == 200
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})).status_code == 200


def test_embedded_engine_lora_request_and_eviction(backend: str, adapters: dict[str, Path]) -> None:
    """generate(lora_request=...) registers on first use; with one host copy (torch), an evicted adapter is read
    back in a worker thread; remove_lora makes the name unknown. On nxd both adapters are compiled in
    (max_loras 2); a lora_request for one that is not fails that request with the clear error."""

    async def collect(engine: AsyncEngine, lora: LoRARequest | None) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens: list[int] = []
        async for out in engine.generate(PROMPT, params, lora_request=lora):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main() -> None:
        l2, l3 = (LoRARequest(n, i, str(adapters[n])) for i, n in ((2, "a2"), (3, "a3")))
        if backend == "nxd":  # compiled in, registered on first use all the same (lora_modules not loaded here)
            config = _config(backend="nxd", lora_modules=[l2, l3])
        else:
            config = _config(max_loras=1, max_cpu_loras=1)
        async with AsyncEngine(config) as engine:
            if backend == "nxd":
                await engine.remove_lora("a2")
                await engine.remove_lora("a3")
            first = await asyncio.gather(collect(engine, l2), collect(engine, l3), collect(engine, None))
            assert sorted(r.lora_name for r in engine.list_loras()) == ["a2", "a3"]
            if backend == "torch":
                loaded = [engine.core.lora.is_loaded(n) for n in ("a2", "a3")]  # type: ignore[union-attr]
                assert loaded.count(True) == 1
            else:
                with pytest.raises(LoRAAdapterError, match="not compiled into the NxD model"):
                    await collect(engine, LoRARequest("a1", 1, str(adapters["a1"])))
            again = await asyncio.gather(collect(engine, l2), collect(engine, l3), collect(engine, None))
            assert again == first and len({tuple(t) for t in first}) == 3
            await engine.remove_lora("a2")
            with pytest.raises(LoRANotFoundError):
                await engine.remove_lora("a2")

    asyncio.run(main())
