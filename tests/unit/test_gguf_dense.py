"""The layer-at-a-time conversion of a llama .gguf file (gguf_dense.py, model_files._write_llama_folder): the
HF names and q/k row order transformers gives, the file's values, one shard per layer with an index, files of
other kinds left to transformers, and (slow) the whole folder equal to transformers' conversion."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from nxdserve import gguf_dense, model_files
from nxdserve.engine.models import gguf_weights
from nxdserve.model_files import default_gguf_path, resolve_model


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def test_names() -> None:
    assert gguf_dense.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_dense.hf_name("output.weight") == "lm_head.weight"
    assert gguf_dense.hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert gguf_dense.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_dense.hf_name("blk.0.attn_q.bias") is None and gguf_dense.hf_name("rope_freqs.weight") is None


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("converted")
    assert model_files._write_llama_folder(default_gguf_path(), out)
    return out


def test_the_default_model_converts_layer_by_layer_to_the_files_values(converted: Path) -> None:
    from gguf import GGUFReader

    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    cached = json.loads((resolve_model(None) / "config.json").read_text())
    version = "transformers_version"  # the cache may have been converted by another transformers release
    assert {k: v for k, v in config.items() if k != version} == {k: v for k, v in cached.items() if k != version}
    index = json.loads((converted / gguf_dense.INDEX).read_text())["weight_map"]
    tensors = _tensors(converted)
    assert set(index) == set(tensors) and all(t.dtype == torch.float32 for t in tensors.values())
    layers = config["num_hidden_layers"]
    assert len(set(index.values())) == layers + 2  # one shard per layer, the embedding and the final norm
    assert len({index[f"model.layers.3.{p}.weight"] for p in ("self_attn.q_proj", "mlp.down_proj")}) == 1
    reader = GGUFReader(str(default_gguf_path()))
    raw = {t.name: t for t in reader.tensors}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for part, name in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("ffn_up", "mlp.up_proj")):
        t = raw[f"blk.5.{part}.weight"]
        codes, scale, offset = gguf_weights.decode_4bit(t.tensor_type.name, t.data, int(t.shape[0]))
        values = (codes.float().view(codes.shape[0], -1, 32) * scale[..., None] + offset[..., None]).flatten(1)
        if part in heads:  # whole rows move: the decoded codes follow the same order
            values = gguf_weights._reverse_permute(values, heads[part])
        torch.testing.assert_close(tensors[f"model.layers.5.{name}.weight"], values, rtol=1e-6, atol=1e-6)
    norm = torch.from_numpy(raw["blk.2.attn_norm.weight"].data.copy())
    torch.testing.assert_close(tensors["model.layers.2.input_layernorm.weight"], norm, rtol=0, atol=0)


def test_other_files_are_left_to_transformers(tmp_path: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(default_gguf_path()))
    llama = SimpleNamespace(model_type="llama", tie_word_embeddings=True, num_attention_heads=9, num_key_value_heads=3)
    assert not gguf_dense.write_weights(reader, SimpleNamespace(**{**vars(llama), "model_type": "qwen2"}), tmp_path)
    odd = SimpleNamespace(tensors=[*reader.tensors[:3], SimpleNamespace(name="blk.0.attn_q.bias")])
    assert not gguf_dense.write_weights(odd, llama, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_the_conversion_equals_transformers(converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files, "_write_llama_folder", lambda *_: False)
    model_files._write_hf_folder(default_gguf_path(), tmp_path, False)
    ours, theirs = _tensors(converted), _tensors(tmp_path)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0)
    for file in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert json.loads((converted / file).read_text()) == json.loads((tmp_path / file).read_text()), file
