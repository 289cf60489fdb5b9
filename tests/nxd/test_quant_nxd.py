"""--quantization on the nxd backend: int8 / fp8 map onto NxD's own quantization keys, NxD's
save_quantized_state_dict writes the quantized checkpoint once, before compiling, and the emulated
application computes with it; formats NxD has not are clear config errors raised before anything compiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.nxd.neuron_config import default_neuron_config, draft_neuron_config
from nxdserve.engine.models import quant
from nxdserve.engine.models.quant import QuantLinear
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.engines import greedy, make_core, run, tokens

PROMPTS = [[1, 450, 3001, 97, 12], [1, 77, 5000, 23, 8, 9, 41]]


def _resolved(**kw: object) -> EngineConfig:
    return EngineConfig(backend="nxd", max_model_len=64, max_num_seqs=2, **kw).resolve(512)  # type: ignore[arg-type]


@pytest.mark.parametrize(("method", "dtype"), [("int8", "int8"), ("rtn-int8", "int8"), ("fp8", "f8e4m3")])
def test_quantization_maps_onto_nxds_keys(method: str, dtype: str, nxd_emulator: Path) -> None:
    path = tiny_model_path("llama")
    kw = default_neuron_config(_resolved(quantization=method), path)
    assert kw["quantized"] is True
    assert kw["quantization_type"] == "per_channel_symmetric" and kw["quantization_dtype"] == dtype
    assert kw["modules_to_not_convert"] == ["lm_head"]
    checkpoint = Path(kw["quantized_checkpoints_path"])
    assert checkpoint.parent.parent == nxd_emulator and dtype in checkpoint.name  # beside the compiled artifacts
    assert "quantized" not in draft_neuron_config(kw, {})  # a fused draft does not share the target's checkpoint
    assert "quantized" not in default_neuron_config(_resolved(), path)


@pytest.mark.parametrize(
    ("method", "instead"),
    [("int4", "NxD Inference has no 4-bit weight format.*--backend torch"), ("rtn", ".*no 4-bit"),
     ("int4-g64", ".*no 4-bit"), ("gguf", "serve the model.s dense HF checkpoint"),
     ("compressed-tensors", "serve the dense checkpoint it was made")],
)  # fmt: skip
def test_formats_nxd_has_not_are_config_errors(method: str, instead: str) -> None:
    with pytest.raises(ConfigError, match=rf"--quantization {method}: not available on the nxd backend; {instead}"):
        default_neuron_config(_resolved(quantization=method), tiny_model_path("llama"))


def test_a_compressed_tensors_checkpoint_is_refused_on_nxd() -> None:
    from tests.quant.checkpoints import compressed_model_path

    with pytest.raises(ConfigError, match="compressed-tensors: not available on the nxd backend"):
        make_core(str(compressed_model_path("w8a16")), "nxd", max_model_len=64)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_model_runs_through_the_emulator_as_on_torch(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronx_distributed_inference.models import application_base

    before = len(application_base.SAVE_QUANTIZED_LOG)
    model = str(tiny_model_path("llama"))
    core = make_core(model, "nxd", quantization=method, max_model_len=64)
    nc = core.backend.app.neuron_config
    checkpoint = Path(nc.quantized_checkpoints_path)
    assert application_base.SAVE_QUANTIZED_LOG[before:] == [str(checkpoint.parent / f".{checkpoint.name}.tmp")]
    state = torch.load(checkpoint, weights_only=True)  # NxD's names and formats: codes plus per-channel scales
    codes = state["layers.0.self_attn.q_proj.weight"]
    assert codes.dtype == (torch.int8 if method == "int8" else torch.float8_e4m3fn)
    assert state["layers.0.self_attn.q_proj.scale"].shape == (codes.shape[0], 1)
    assert not any(name.startswith("lm_head") for name in state)
    down = core.backend.app.target.model.layers[1].down_weight
    assert isinstance(down, QuantLinear) and down.kind == method  # the emulated model computes with the codes
    nxd_tokens = tokens(run(core, PROMPTS, greedy(8)))
    # NxD's per-channel absmax codes on torch too (torch's own fp8 default has searched 32-column block scales).
    monkeypatch.setattr(quant, "fp8_per_channel_absmax", True)
    torch_core = make_core(model, "torch", quantization=method, max_model_len=64)
    assert nxd_tokens == tokens(run(torch_core, PROMPTS, greedy(8)))  # the same per-channel weights as on torch
    dense = make_core(model, "nxd", max_model_len=64)
    assert not isinstance(dense.backend.app.target.model.layers[1].down_weight, QuantLinear)
    # A second start finds the checkpoint (and the compiled artifacts) and quantizes nothing again.
    again = make_core(model, "nxd", quantization=method, max_model_len=64)
    assert len(application_base.SAVE_QUANTIZED_LOG) == before + 1
    assert tokens(run(again, PROMPTS, greedy(8))) == nxd_tokens


def test_overrides_reach_nxd_and_a_folder_gets_safetensors(tmp_path: Path) -> None:
    """--override-neuron-config on top of the mapping: per-tensor scales, and a checkpoint folder NxD fills
    with safetensors (in place: it exists before the save)."""
    from safetensors.torch import load_file

    folder = tmp_path / "quantized"
    folder.mkdir()
    overrides = {"quantization_type": "per_tensor_symmetric", "quantized_checkpoints_path": str(folder)}
    core = make_core(str(tiny_model_path("llama")), "nxd", quantization="int8", max_model_len=64,
                     override_neuron_config=overrides)  # fmt: skip
    state = load_file(str(folder / "model.safetensors"))
    assert state["layers.1.mlp.down_proj.scale"].shape == (1, 1)  # one scale for the whole tensor
    qkv = core.backend.app.target.model.layers[0].qkv_weight
    assert isinstance(qkv, QuantLinear) and qkv.kind == "int8"
    q_rows = state["layers.0.self_attn.q_proj.weight"].shape[0]
    assert torch.all(qkv.scales[:q_rows] == state["layers.0.self_attn.q_proj.scale"].reshape(()))
    assert all(len(t) == 6 for t in tokens(run(core, PROMPTS, greedy(6))))


def test_the_default_model_stays_dense_on_nxd() -> None:
    """The torch backend serves the default model from its 4-bit blocks by default; NxD reads dense checkpoints,
    so there the same default (no --quantization, no --dtype) is the dense model, as before."""
    core = make_core(None, dtype="auto", max_model_len=64, max_num_seqs=2)
    assert core.backend.name == "nxd" and core.config.quantization is None
    (out,) = tokens(run(core, PROMPTS[:1], greedy(4)))
    assert len(out) == 4
