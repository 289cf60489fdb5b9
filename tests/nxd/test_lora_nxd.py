"""Multi-LoRA on the nxd backend, through the emulator: --lora-modules map to NxD's LoraServingConfig at compile
time, each row passes its adapter index (0: base) as ``adapter_ids``, and a mixed batch gives the torch
backend's tokens (which tests/lora checks against transformers + peft). Adapters NxD did not compile in are a
clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdserve.engine.core import EngineCore
from nxdserve.errors import ConfigError, LoRAAdapterError
from nxdserve.lora.request import LoRARequest
from tests.helpers.lora import make_peft_adapter
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.engines import greedy, make_core

PROMPTS = [[1, 450, 7483, 310, 3444, 338], [1, 3014, 263, 2], [1, 22172, 29892, 590, 1024], [1, 5, 6, 7]]


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    base, root = tiny_model_path("llama"), tmp_path_factory.mktemp("nxd-adapters")
    a = make_peft_adapter(base, root / "a", seed=5)
    b = make_peft_adapter(base, root / "b", targets=("q_proj", "v_proj", "down_proj"), rank=4, alpha=8, seed=6)
    return [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]


def _core(backend: str, modules: list[LoRARequest]) -> EngineCore:
    core = make_core(str(tiny_model_path("llama")), backend, enable_lora=True, max_loras=2, lora_modules=modules)
    assert core.lora is not None
    for module in modules:
        core.lora.load(module)
    return core


def _run(core: EngineCore, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    assert core.lora is not None
    ids = []
    for prompt, name in jobs:
        request = core.make_request(prompt, greedy(8), lora=None if name is None else core.lora.resolve(name))
        core.add_request(request)
        ids.append(request.request_id)
    finals = {}
    while core.has_unfinished:
        finals.update({o.request_id: o for o in core.step() if o.finished})
    return [list(finals[i].outputs[0].token_ids) for i in ids]


def test_mixed_batch_matches_the_torch_backend(modules: list[LoRARequest]) -> None:
    jobs = [(PROMPTS[i], name) for i, name in enumerate([None, "a", "b", "a"])]
    nxd = _core("nxd", modules)
    nc = nxd.backend.app.neuron_config  # type: ignore[attr-defined]
    lora = nc.lora_config
    assert (lora.max_loras, lora.max_lora_rank, lora.enable_base_model_only) == (2, 16, True)
    assert lora.lora_ckpt_paths == {"a": modules[0].lora_path, "b": modules[1].lora_path}
    assert set(lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    got = _run(nxd, jobs)
    expected = _run(_core("torch", modules), jobs)
    assert got == expected
    assert got[1] != _run(nxd, [(PROMPTS[1], None)])[0]  # the adapter changes the output
    alone = [_run(nxd, [job])[0] for job in jobs]
    assert alone == got


def test_adapters_not_compiled_in_are_refused(modules: list[LoRARequest], tmp_path: Path) -> None:
    core = _core("nxd", modules[:1])
    assert core.lora is not None
    other = make_peft_adapter(tiny_model_path("llama"), tmp_path / "c", seed=7)
    with pytest.raises(LoRAAdapterError, match="not compiled into the NxD model"):
        core.lora.load(LoRARequest("c", 3, str(other)))
    with pytest.raises(ConfigError, match="needs its adapters at compile time"):
        make_core(str(tiny_model_path("llama")), "nxd", enable_lora=True)
    with pytest.raises(ConfigError, match="--max-loras"):
        make_core(str(tiny_model_path("llama")), "nxd", enable_lora=True, max_loras=1, lora_modules=modules)
    # NxD's buffers are compiled at --max-lora-rank: a larger adapter is refused before the build.
    with pytest.raises(ConfigError, match="LoRA rank 8 is greater than --max-lora-rank 1"):
        make_core(str(tiny_model_path("llama")), "nxd", enable_lora=True, max_loras=2, max_lora_rank=1,
                  lora_modules=modules)
