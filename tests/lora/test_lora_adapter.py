"""PEFT adapter loading: what fits the base model loads with PEFT's scaling folded in; everything else is a
LoRAAdapterError at load naming the problem, never a failure inside a forward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nxdserve.engine.models.spec import ModelSpec
from nxdserve.errors import LoRAAdapterError, LoRANotFoundError
from nxdserve.lora.adapter import load_peft_adapter
from nxdserve.lora.registry import LoraRegistry
from nxdserve.lora.request import LoRARequest
from nxdserve.model_files import load_hf_config
from tests.helpers.lora import make_peft_adapter
from tests.helpers.tiny_model import tiny_model_path


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return ModelSpec.from_hf_config(load_hf_config(tiny_model_path("llama")))


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_model_path("llama"), tmp_path_factory.mktemp("a") / "a", rank=8, alpha=16, seed=4)


def test_loads_with_peft_scaling(spec: ModelSpec, adapter_dir: Path, tmp_path: Path) -> None:
    adapter = load_peft_adapter(adapter_dir, spec, 16, "a", 1)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert adapter.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = next(k for k in tensors if "layers.1.self_attn.v_proj.lora_B" in k)
    a, b = adapter.weights[(1, "v_proj")]
    assert torch.equal(b, tensors[key] * 2.0) and a.shape == (8, spec.hidden_size)
    rs = make_peft_adapter(tiny_model_path("llama"), tmp_path / "rs", rank=4, alpha=8, rslora=True)
    assert load_peft_adapter(rs, spec, 16, "rs", 2).scaling == pytest.approx(8 / math.sqrt(4))


def test_rank_over_maximum(spec: ModelSpec, adapter_dir: Path) -> None:
    with pytest.raises(LoRAAdapterError, match="LoRA rank 8 is greater than max_lora_rank 1"):
        load_peft_adapter(adapter_dir, spec, 1, "a", 1)


def test_unsupported_target(spec: ModelSpec, tmp_path: Path) -> None:
    bad = make_peft_adapter(tiny_model_path("llama"), tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(LoRAAdapterError, match=r"unsupported modules \['lm_head'\]"):
        load_peft_adapter(bad, spec, 16, "head", 1)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["target_modules"] = ".*lm_head|.*q_proj"  # a regex: the tensors themselves are checked
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAAdapterError, match=r"unsupported tensor .*lm_head"):
        load_peft_adapter(bad, spec, 16, "head", 1)


def test_shapes_of_another_model(spec: ModelSpec, tmp_path: Path) -> None:
    other = make_peft_adapter(tiny_model_path("llama-llama3-untied"), tmp_path / "other", targets=("k_proj",))
    with pytest.raises(LoRAAdapterError, match=r"k_proj has A .* this base model needs"):
        load_peft_adapter(other, spec, 16, "other", 1)


@pytest.mark.parametrize(("key", "value"), [("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all")])
def test_unsupported_features(spec: ModelSpec, adapter_dir: Path, tmp_path: Path, key: str, value: object) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config[key] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoRAAdapterError, match=key):
        load_peft_adapter(folder, spec, 16, "f", 1)


def test_missing_files(spec: ModelSpec, tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match=r"no adapter_config\.json"):
        load_peft_adapter(tmp_path, spec, 16, "none", 1)


def test_registry_names_ids_and_lru(spec: ModelSpec, adapter_dir: Path) -> None:
    registry = LoraRegistry(spec, max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    registry.load(LoRARequest("a", 1, str(adapter_dir)))
    with pytest.raises(LoRAAdapterError, match="already been loaded"):
        registry.load(LoRARequest("a", 2, str(adapter_dir)))
    with pytest.raises(LoRAAdapterError, match="lora_int_id 1"):
        registry.load(LoRARequest("b", 1, str(adapter_dir)))
    registry.load(LoRARequest("b", 2, str(adapter_dir)))
    assert not registry.is_loaded("a") and registry.is_loaded("b")  # host LRU of one
    assert registry.resolve("a").int_id == 1 and not registry.is_loaded("b")
    with pytest.raises(LoRANotFoundError):
        registry.resolve("nope")
    registry.unload("a")
    with pytest.raises(LoRANotFoundError):
        registry.unload("a")


def test_config_limits(spec: ModelSpec) -> None:
    with pytest.raises(LoRAAdapterError, match="max_lora_rank 7"):
        LoraRegistry(spec, 1, 7, None)
    with pytest.raises(LoRAAdapterError, match="max_cpu_loras"):
        LoraRegistry(spec, 4, 16, 2)
    with pytest.raises(LoRAAdapterError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
