"""Pre-quantized compressed-tensors checkpoints (engine/models/compressed_tensors.py), built in the test with the
library's own compressors (tests/quant/checkpoints.py), served from their codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.models import quant
from nxdserve.engine.models.compressed_tensors import METHOD, CompressedCheckpoint, resolve_quantization
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.perplexity import next_token_logits
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path
from tests.quant.checkpoints import compressed_model_path

IDS = [1, 450, 3001, 97, 12, 5000, 23, 8]
# scheme -> the runtime format its linears are served in
KINDS = {
    "w8a16": "int8", "w8a8": "int8", "w4a16": "int4", "w4a16-asym": "int4", "w4a16-channel": "int4",
    "fp8-dynamic": "fp8", "fp8": "fp8", "w8a16-g32": "q8_0",
}  # fmt: skip



def _load(path: Path) -> LlamaFamilyModel:
    return LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"), max_len=64)


def _library_dense(path: Path) -> dict[str, torch.Tensor]:
    """Every quantized module's weight as the compressed-tensors library itself decompresses it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k not in ("version",
                                                                                          "sparsity_config",
                                                                                          "transform_config")})
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format or config.format)
    tensors = load_file(str(path / "model.safetensors"))
    modules = {key.removesuffix(".weight_scale") for key in tensors if key.endswith(".weight_scale")}
    out = {}
    for module in modules:
        state = {k.removeprefix(module + "."): v for k, v in tensors.items()
                 if k.startswith(module + ".") and not k.endswith("input_scale")}
        out[module] = compressor.decompress(state, scheme)["weight"].float()
    return out


@pytest.mark.parametrize("scheme", sorted(KINDS))
def test_checkpoint_is_served_from_its_codes_with_the_dequantized_logits(scheme: str, exact_kernels: None) -> None:
    path = compressed_model_path(scheme)
    assert resolve_quantization(None, path) == METHOD  # auto-detected from config.json, as vLLM does
    dense = _load(path)  # the quantized modules decompressed: the dequantized reference
    model = _load(path)
    quant.quantize_model(model, METHOD, checkpoint=path)
    library = _library_dense(path)
    assert model.lm_head_quant is None  # ignore: ["lm_head"]
    for i, layer in enumerate(model.layers):
        assert "qkv_weight" not in dict(layer.named_parameters())  # the dense copies are gone
        for attr in LlamaFamilyModel.QUANTIZABLE:
            q = getattr(layer, attr)
            assert isinstance(q, quant.QuantLinear) and q.kind == KINDS[scheme]
            assert q.nbytes < q.out_features * q.in_features * 4 * 0.3  # codes, not a dense copy
            torch.testing.assert_close(q.dequantize(), getattr(dense.layers[i], attr).detach(), rtol=0, atol=1e-7)
        # our codes expand to exactly what the library decompresses
        q, k, v = (library[f"model.layers.{i}.self_attn.{p}_proj"] for p in "qkv")
        torch.testing.assert_close(layer.qkv_weight.dequantize(), torch.cat((q, k, v)), rtol=0, atol=1e-7)
        down = library[f"model.layers.{i}.mlp.down_proj"]
        torch.testing.assert_close(layer.down_weight.dequantize(), down, rtol=0, atol=1e-7)
    original = next_token_logits(_load(tiny_model_path("llama")), IDS)
    ref, got = next_token_logits(dense, IDS), next_token_logits(model, IDS)
    assert not torch.allclose(ref, original, atol=1e-3)  # the codes are not the original weights ...
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # ... and the model computes with them


def test_transformers_own_loader_gives_the_same_logits(exact_kernels: None) -> None:
    """transformers' compressed-tensors loader (decompressing on load) as the reference, W4A16."""
    from transformers import AutoModelForCausalLM

    path = compressed_model_path("w4a16")
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = reference(torch.tensor([IDS])).logits[0]
    model = _load(path)
    quant.quantize_model(model, METHOD, checkpoint=path)
    torch.testing.assert_close(next_token_logits(model, IDS), ref, rtol=1e-4, atol=1e-4)


def test_quantization_flag_is_checked_against_the_checkpoint(tmp_path: Path) -> None:
    path = compressed_model_path("w4a16")
    assert resolve_quantization(METHOD, path) == METHOD
    with pytest.raises(ConfigError, match=r"--quantization int8: .*already quantized \(compressed-tensors\)"):
        resolve_quantization("int8", path)
    dense = tiny_model_path("llama")
    assert resolve_quantization(None, dense) is None and resolve_quantization("int8", dense) == "int8"
    with pytest.raises(ConfigError, match="no compressed-tensors quantization_config"):
        resolve_quantization(METHOD, dense)
    awq = tmp_path / "awq"
    shutil.copytree(dense, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantized with 'awq'"):
        resolve_quantization(None, awq)
    EngineConfig(quantization=METHOD).resolve(512)  # a valid --quantization value


def test_unsupported_schemes_are_config_errors_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="4-bit groups of 16 have no exact layout"):
        CompressedCheckpoint(compressed_model_path("w4a16-g16")).quantized_linears(2)
    block = tmp_path / "block"
    shutil.copytree(compressed_model_path("fp8-dynamic"), block)
    config = json.loads((block / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(strategy="block", block_structure=[32, 32])
    (block / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"8-bit float, strategy block.*not block-wise FP8"):
        CompressedCheckpoint(block)
    marlin = tmp_path / "marlin"
    shutil.copytree(compressed_model_path("w4a16"), marlin)
    config = json.loads((marlin / "config.json").read_text())
    config["quantization_config"]["format"] = "marlin-24"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
    (marlin / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="stored as 'marlin-24'; served formats: pack-quantized"):
        CompressedCheckpoint(marlin)


def test_engine_serves_a_compressed_checkpoint_without_the_flag() -> None:
    from nxdserve.sampling_params import SamplingParams
    from tests.helpers.engine import make_core, run_to_completion

    core = make_core(model=str(compressed_model_path("w4a16")), max_model_len=64, max_num_seqs=4)
    assert core.config.quantization == METHOD
    assert isinstance(core.backend.model.layers[1].gate_up_weight, quant.QuantLinear)
    prompts = [[1, 450, 3001, 97], [1, 12, 5000, 23, 8, 77]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in run_to_completion(core, prompts, params)]
    alone = [run_to_completion(core, [p], params)[0].outputs[0].token_ids for p in prompts]
    assert all(len(t) == 5 for t in together)
    assert together == alone
