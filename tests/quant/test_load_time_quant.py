"""Quantizing as the checkpoint loads (``LlamaFamilyModel.load_weights(quantize_linear=...)``,
``quant.linear_quantizer``): each decoder linear is quantized as soon as the checkpoint has filled it, the result
is the same as quantizing the loaded dense model, the calibrated methods are left to after the load, and the
torch backend loads that way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.backends.torch_backend import TorchBackend
from nxdserve.engine.models import quant
from nxdserve.engine.models.llama import LlamaFamilyModel, checkpoint_tensors
from nxdserve.engine.models.perplexity import next_token_logits
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path

IDS = list(range(5, 37))
STREAMED = ("int8", "fp8", "int4", "rtn")


def _maker(method: str, path: Path) -> quant.LinearMaker:
    model = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"))
    make = quant.linear_quantizer(method, model.spec, len(model.layers), checkpoint=path)
    assert make is not None
    return make


def _same_weights(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        return
    assert isinstance(a, quant.QuantLinear) and isinstance(b, quant.QuantLinear)
    torch.testing.assert_close(a.data, b.data, rtol=0, atol=0)
    torch.testing.assert_close(a.scales, b.scales, rtol=0, atol=0)
    if a.offsets is not None:
        torch.testing.assert_close(a.offsets, b.offsets, rtol=0, atol=0)


@pytest.mark.parametrize("method", STREAMED)
def test_quantized_at_load_equals_quantized_after(method: str) -> None:
    path = tiny_model_path("llama-linear-bias")
    make = _maker(method, path)
    streamed = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"), quantize_linear=make)
    linears = [getattr(layer, a) for layer in streamed.layers for a in streamed.QUANTIZABLE]
    assert all(isinstance(q, quant.QuantLinear) for q in linears)
    quant.quantize_model(streamed, method, make=make)  # the LM head, as the backend finishes a load
    after = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"))
    quant.quantize_model(after, method)
    for layer_s, layer_a in zip(streamed.layers, after.layers, strict=True):
        for attr in streamed.QUANTIZABLE:
            _same_weights(getattr(layer_s, attr), getattr(layer_a, attr))
    torch.testing.assert_close(next_token_logits(streamed, IDS), next_token_logits(after, IDS), rtol=0, atol=0)


def test_each_linear_is_quantized_before_the_next_tensor_is_read() -> None:
    """The maker sees a linear right after the checkpoint tensor that completes it (q/k/v and gate/up fused
    first), with its checkpoint values, and the dense tensor is gone from the layer afterwards."""
    path = tiny_model_path("llama")
    model = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"))
    events: list[str] = []
    dense = {name: tensor.clone() for name, tensor in checkpoint_tensors(path)}

    def reading() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in checkpoint_tensors(path):
            events.append(f"read {name}")
            yield name, tensor

    def make(name: str, weight: torch.Tensor) -> quant.QuantLinear | None:
        events.append(f"make {name}")
        if name == "layers.1.down_weight":
            torch.testing.assert_close(weight, dense["model.layers.1.mlp.down_proj.weight"], rtol=0, atol=0)
        return quant.quantize_int8(weight)

    fresh = LlamaFamilyModel(model.spec, _hf_config(path), torch.float32, torch.device("cpu"), None)
    fresh.load_weights(reading(), make)
    made = [e for e in events if e.startswith("make")]
    assert len(made) == 4 * len(fresh.layers) and "make lm_head" not in made
    for i, event in enumerate(events):
        if event.startswith("make"):
            read = events[i - 1].removeprefix("read model.")
            # the tensor read just before completes this linear: layers.{i}.(q|k|v)_proj / gate|up / o / down
            index = event.split(".")[1]
            assert read.startswith(f"layers.{index}."), (event, read)
    for layer in fresh.layers:
        assert all(a not in layer._parameters for a in fresh.QUANTIZABLE)


def _hf_config(path: Path) -> object:
    from nxdserve.model_files import load_hf_config

    return load_hf_config(path)


def test_calibrated_methods_and_bad_names() -> None:
    path = tiny_model_path("llama")
    model = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"))
    for method in ("int4-g64", "int4-g128"):  # calibrated on the dense model: after the load
        assert quant.linear_quantizer(method, model.spec, len(model.layers), checkpoint=path) is None
    with pytest.raises(ConfigError, match="int3"):
        quant.linear_quantizer("int3", model.spec, len(model.layers))
    with pytest.raises(ConfigError, match=r"\.gguf file"):
        quant.linear_quantizer("gguf", model.spec, len(model.layers), gguf_path=None)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_backend_quantizes_as_it_loads(quantization: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's model: int8 linears (or, with no --quantization and --dtype auto on a CPU build without
    native bf16, bf16 weights) made during ``load_weights``; greedy output as quantizing after the load."""
    seen: list[str] = []
    original = LlamaFamilyModel.load_weights

    def load_weights(self: LlamaFamilyModel, weights: object, quantize_linear: object = None) -> None:
        seen.append("streamed" if quantize_linear is not None else "dense")
        original(self, weights, quantize_linear)  # type: ignore[arg-type]

    monkeypatch.setattr(LlamaFamilyModel, "load_weights", load_weights)
    path = tiny_model_path("llama")
    kw: dict[str, object] = {"cpu": CpuOptions(isa="avx2")} if quantization is None else {"dtype": "float32"}
    config = EngineConfig(
        model=str(path), backend="torch", max_model_len=64, max_num_seqs=2, seed=0, quantization=quantization,
        **kw,  # type: ignore[arg-type]
    ).resolve(model_max_positions=512)
    backend = TorchBackend(path, config)
    want = "int8" if quantization else "bf16"
    kinds = {getattr(layer, a).kind for layer in backend.model.layers for a in backend.model.QUANTIZABLE}
    assert kinds == {want} and seen == ["streamed"]
    after = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"))
    if quantization:
        quant.quantize_model(after, quantization)
    else:
        after.quantize_linears(lambda _name, weight: quant.store_bf16(weight))
    torch.testing.assert_close(
        next_token_logits(backend.model, IDS), next_token_logits(after, IDS), rtol=1e-5, atol=1e-5
    )
