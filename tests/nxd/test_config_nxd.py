"""NeuronConfig building, overrides, model-class choice, artifact folders and derived limits."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.nxd.app import build_inference_config
from nxdserve.engine.backends.nxd.neuron_config import (
    NxdSettings,
    artifact_dir,
    artifact_key,
    default_neuron_config,
    draft_neuron_config,
    merge_overrides,
    model_type_key,
    pick_model_class,
)
from nxdserve.errors import ConfigError
from nxdserve.model_files import load_hf_config
from tests.helpers.tiny_model import tiny_model_path


def resolved(**kw: object) -> EngineConfig:
    settings: dict[str, object] = {"max_model_len": 1024, "max_num_seqs": 8}
    settings.update(kw)
    return EngineConfig(**settings).resolve(4096)  # type: ignore[arg-type]


def test_defaults_follow_the_vllm_plugin() -> None:
    kw = default_neuron_config(resolved(tensor_parallel_size=8))
    assert kw["tp_degree"] == 8 and kw["batch_size"] == 8 and kw["ctx_batch_size"] == 1
    assert kw["seq_len"] == kw["max_context_length"] == 1024
    assert kw["is_continuous_batching"] and kw["enable_bucketing"] and kw["padding_side"] == "right"
    assert kw["on_device_sampling_config"] == {"dynamic": True, "deterministic": False, "global_topk": 256}
    assert kw["torch_dtype"] == "bfloat16"  # auto on Neuron
    assert default_neuron_config(resolved(dtype="float32"))["torch_dtype"] == "float32"
    assert not default_neuron_config(resolved(max_num_seqs=1))["is_continuous_batching"]


def test_fused_speculation_keys() -> None:
    spec = {"method": "eagle", "model": "/d", "num_speculative_tokens": 3}
    kw = default_neuron_config(resolved(speculative_config=spec))
    assert kw["speculation_length"] == 4 and kw["enable_fused_speculation"] and kw["enable_eagle_speculation"]
    ngram = default_neuron_config(resolved(speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    assert "speculation_length" not in ngram
    draft = draft_neuron_config({**kw, "tp_degree": 8}, {"tp_degree": 2})
    assert draft["is_eagle_draft"] and not draft["enable_fused_speculation"] and draft["tp_degree"] == 2
    assert draft_neuron_config({"speculation_length": 4}, {})["speculation_length"] == 0


def test_overrides_merge_one_level_deep() -> None:
    base = default_neuron_config(resolved())
    merged, draft = merge_overrides(base, {"on_device_sampling_config": {"global_topk": 64}, "output_logits": True,
                                           "draft_overrides": {"tp_degree": 1}})
    assert merged["on_device_sampling_config"] == {"dynamic": True, "deterministic": False, "global_topk": 64}
    assert merged["output_logits"] and draft == {"tp_degree": 1}
    assert base["on_device_sampling_config"]["global_topk"] == 256  # the defaults are not mutated
    assert merge_overrides(base, {"on_device_sampling_config": None})[0]["on_device_sampling_config"] is None
    with pytest.raises(ConfigError, match="is_prefix_caching"):
        merge_overrides(base, {"is_prefix_caching": True})
    with pytest.raises(ConfigError, match="draft_overrides"):  # the draft may not switch them on either
        merge_overrides(base, {"draft_overrides": {"is_block_kv_layout": True}})


@pytest.mark.parametrize(
    ("arch", "key"),
    [("LlamaForCausalLM", ("llama", "causal-lm")), ("Qwen3MoeForCausalLM", ("qwen3_moe", "causal-lm")),
     ("MllamaForConditionalGeneration", ("mllama", "causal-lm")), ("GptOssForCausalLM", ("gpt_oss", "causal-lm")),
     ("Llama4ForImageEncoding", ("llama4", "image-encoding")),
     ("LlavaForConditionalGeneration", ("pixtral", "causal-lm"))],
)
def test_architecture_to_model_type(arch: str, key: tuple[str, str]) -> None:
    assert model_type_key(arch) == key


def test_pick_model_class() -> None:
    table = {"llama": {"causal-lm": "L"}, "qwen2": {"causal-lm": "Q"}}
    assert pick_model_class(SimpleNamespace(architectures=["Qwen2ForCausalLM"]), table) == "Q"
    assert pick_model_class(SimpleNamespace(architectures=None, model_type="llama"), table) == "L"
    with pytest.raises(ConfigError, match="supported model types: llama, qwen2"):
        pick_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"), table)


def test_inference_config_from_the_engine_config() -> None:
    path = tiny_model_path("qwen3")
    config = resolved(dtype="float32", max_model_len=256, max_num_seqs=4,
                      override_neuron_config={"output_logits": True})
    cls, inference_config = build_inference_config(path, config, load_hf_config(path))
    nc = inference_config.neuron_config
    assert cls.__name__ == "NeuronQwen3ForCausalLM"
    assert nc.batch_size == 4 and nc.max_length == 256 and nc.torch_dtype == torch.float32 and nc.output_logits
    assert inference_config.hidden_size == 64  # the HF config is copied in
    other = build_inference_config(path, resolved(dtype="float32", max_model_len=256, max_num_seqs=4),
                                   load_hf_config(path))[1]
    assert artifact_key(inference_config.to_json_string()) != artifact_key(other.to_json_string())


def test_artifact_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NXDSERVE_NEURON_ARTIFACTS", str(tmp_path))
    assert artifact_dir(Path("/m/llama"), "abc") == (tmp_path / "llama-abc", False)
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "mine"))
    assert artifact_dir(Path("/m/llama"), "abc") == (tmp_path / "mine", True)


def _settings(**kw: object) -> NxdSettings:
    base: dict[str, object] = {"batch_size": 4, "max_context_length": 256, "max_length": 256,
                               "cte_buckets_largest": 256, "tkg_buckets_largest": 256,
                               "on_device_sampling": True, "global_topk": 256,
                               "output_logits": False, "speculation_length": 0, "eagle": False,
                               "seq_ids_mask": False, "pad_token_id": 0}
    base.update(kw)
    return NxdSettings(**base)  # type: ignore[arg-type]


def test_limits_and_sampling_modes() -> None:
    assert _settings().max_model_len == 256 and _settings().sampling_mode == "device"
    assert _settings(speculation_length=5).max_model_len == 253  # p + 5 <= 256 with p = N - 2
    # token-generation buckets that stop below max_length are the limit (NxD raises past the largest)
    assert _settings(tkg_buckets_largest=128).max_model_len == 128
    assert _settings(tkg_buckets_largest=128, speculation_length=5).max_model_len == 125
    assert _settings(output_logits=True).sampling_mode == "hybrid"
    assert _settings(output_logits=True, speculation_length=5).sampling_mode == "device"
    assert _settings(on_device_sampling=False, global_topk=None).sampling_mode == "cpu"


def _tiny_qwen2_vl_config(folder: Path) -> Path:
    """A Qwen2-VL checkpoint's config.json only: the adapter decides from the config, before any weight loads."""
    from transformers import Qwen2VLConfig

    Qwen2VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 512, "rope_scaling": {"type": "mrope",
                                                                                   "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
        architectures=["Qwen2VLForConditionalGeneration"],
    ).save_pretrained(folder)
    return folder


def test_image_to_text_configs_take_a_text_and_a_vision_neuron_config() -> None:
    """The contract the old adapter broke: one NeuronConfig is a TypeError in NxD's image-to-text configs."""
    from neuronx_distributed_inference.models.config import NeuronConfig
    from neuronx_distributed_inference.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLInferenceConfig

    with pytest.raises(TypeError, match="vision_neuron_config"):
        Qwen2VLInferenceConfig(NeuronConfig(), load_config=lambda c: None)


def _tiny_mllama_config(folder: Path) -> Path:
    from transformers import MllamaConfig

    MllamaConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 512, "cross_attention_layers": [1]},
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_global_layers": 1, "attention_heads": 2,
                       "intermediate_size": 64, "image_size": 56, "patch_size": 14},
        architectures=["MllamaForConditionalGeneration"],
    ).save_pretrained(folder)
    return folder


def test_vision_language_checkpoints_other_than_qwen2_vl_are_refused_at_start_up(tmp_path: Path) -> None:
    path = _tiny_mllama_config(tmp_path / "mllama")
    refusal = r"MllamaForConditionalGeneration is a vision-language model \(NeuronMllamaForCausalLM\).*Qwen2-VL only"
    with pytest.raises(ConfigError, match=refusal):
        build_inference_config(path, resolved(dtype="float32", max_model_len=256, max_num_seqs=4), load_hf_config(path))


def test_qwen2_vl_builds_a_text_and_a_vision_neuron_config(tmp_path: Path) -> None:
    path = _tiny_qwen2_vl_config(tmp_path / "qwen2-vl")
    cls, config = build_inference_config(
        path, resolved(dtype="float32", max_model_len=256, max_num_seqs=4), load_hf_config(path)
    )
    assert cls.__name__ == "NeuronQwen2VLForCausalLM" and type(config).__name__ == "Qwen2VLInferenceConfig"
    text, vision = config.text_config.neuron_config, config.vision_config.neuron_config
    assert (text.batch_size, text.seq_len, text.tp_degree) == (4, 256, 1)
    # NxD's default 640x320 image: 22x46 patches, 253 tokens; one fits the 256-token text bucket.
    assert (vision.default_image_width, vision.default_image_height, vision.buckets) == (640, 320, [1])
    assert vision.fused_qkv is True and vision.batch_size == 1
