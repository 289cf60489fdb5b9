"""Model selection as vLLM users expect it: hub ids from a local Hugging Face cache by revision (never a
download), the generation config's sampling defaults with overrides, and KV sizing into slots."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from nxdserve.config import EngineConfig
from nxdserve.engine.kv_sizing import KVBudget, fit_slots, kv_budget, kv_bytes_per_slot
from nxdserve.engine.loader import generation_defaults
from nxdserve.errors import ConfigError
from nxdserve.model_files import hub_cache_dirs, looks_like_hub_id, resolve_model

MAIN = "a" * 40
DEV = "b" * 40


def _model_folder(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"tag": tag}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _cache(root: Path, repo_id: str = "org/model") -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    _model_folder(repo / "snapshots" / MAIN, "main")
    _model_folder(repo / "snapshots" / DEV, "dev")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN + "\n")
    (repo / "refs" / "dev").write_text(DEV)
    return root


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(_cache(tmp_path / "hub")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def _tag(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["tag"]  # type: ignore[no-any-return]


def test_hub_id_resolves_by_branch_tag_or_commit(hub: Path) -> None:
    assert _tag(resolve_model("org/model")) == "main"
    assert _tag(resolve_model("org/model", revision="dev")) == "dev"
    assert _tag(resolve_model("org/model", revision=DEV)) == "dev"


def test_download_dir_is_searched_first(hub: Path, tmp_path: Path) -> None:
    other = _cache(tmp_path / "other")
    (other / "models--org--model" / "refs" / "main").write_text(DEV)  # this cache's main is the dev snapshot
    assert _tag(resolve_model("org/model", download_dir=str(other))) == "dev"
    assert hub_cache_dirs(str(other)) == [other, hub]


def test_hf_home_is_used_without_hf_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    _cache(tmp_path / "home" / "hub")
    assert _tag(resolve_model("org/model")) == "main"


def test_missing_revision_or_id_names_where_it_looked(hub: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_model("org/model", revision="v9")
    assert "revision v9" in str(info.value) and str(hub / "models--org--model") in str(info.value)
    with pytest.raises(ConfigError, match="never downloads"):
        resolve_model("org/other")


def test_tokenizer_folder_needs_no_weights(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_model(str(tmp_path), require_weights=False) == tmp_path.resolve()
    with pytest.raises(ConfigError):
        resolve_model(str(tmp_path))


def test_hub_id_shape() -> None:
    assert looks_like_hub_id("org/name") and looks_like_hub_id("gpt2")
    assert not any(map(looks_like_hub_id, ["/abs/path", "./rel", "~/m", "a/b/c", "m.gguf", " "]))


def _generation_folder(folder: Path, **values: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_generation_config_modes_and_overrides(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _generation_folder(tmp_path / "model", temperature=0.6, top_p=0.9, max_new_tokens=64, do_sample=True)
    other = _generation_folder(tmp_path / "other", top_k=5)
    assert generation_defaults(EngineConfig(), model) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert generation_defaults(EngineConfig(generation_config="vllm"), model) == {}
    assert generation_defaults(EngineConfig(generation_config=str(other)), model) == {"top_k": 5}
    config = EngineConfig(override_generation_config={"temperature": 0.1, "max_new_tokens": 8})
    with caplog.at_level(logging.INFO, logger="nxdserve.engine.loader"):
        assert generation_defaults(config, model) == {"temperature": 0.1, "top_p": 0.9, "max_tokens": 8}
    assert "--override-generation-config" in caplog.text  # logged at start-up
    vllm_plus = EngineConfig(generation_config="vllm", override_generation_config={"repetition_penalty": 1.1})
    assert generation_defaults(vllm_plus, model) == {"repetition_penalty": 1.1}
    with pytest.raises(ConfigError, match="do_sample"):
        generation_defaults(EngineConfig(override_generation_config={"do_sample": True}), model)
    with pytest.raises(ConfigError, match=r"no generation_config\.json"):
        generation_defaults(EngineConfig(generation_config=str(tmp_path)), model)


HF = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)


def test_kv_bytes_per_slot_matches_the_cache_layout() -> None:
    # layers x (K, V) x kv heads x positions x head dim x bytes: the default model in bf16 at 2048 tokens
    assert kv_bytes_per_slot(HF, 2048, 2) == 30 * 2 * 3 * 2048 * 64 * 2


def test_fit_slots_lowers_caps_and_refuses() -> None:
    per_slot = kv_bytes_per_slot(HF, 1024, 4)
    config = EngineConfig(max_model_len=1024, max_num_seqs=64)
    assert fit_slots(config, KVBudget(10 * per_slot + 1, "test"), per_slot) == 10 and config.max_num_seqs == 10
    config = EngineConfig(max_model_len=1024, max_num_seqs=4)
    assert fit_slots(config, KVBudget(100 * per_slot, "test"), per_slot) == 4  # max_num_seqs stays the cap
    with pytest.raises(ConfigError, match="lower --max-model-len"):
        fit_slots(EngineConfig(max_model_len=1024), KVBudget(per_slot - 1, "test"), per_slot)


def test_kv_budget_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert kv_budget(EngineConfig(), "cpu", tmp_path) is None
    given = kv_budget(EngineConfig(kv_cache_memory_bytes=123), "cpu", tmp_path)
    assert given == KVBudget(123, "--kv-cache-memory-bytes")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    budget = kv_budget(EngineConfig(), "cpu", tmp_path)
    assert budget is not None and budget.bytes == 2 * 2**30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM: 0 = decide automatically
    assert kv_budget(EngineConfig(), "cpu", tmp_path) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ConfigError, match="GiB"):
        kv_budget(EngineConfig(), "cpu", tmp_path)
