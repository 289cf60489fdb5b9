"""Model resolution: the embedded default model's one-time conversion, its cache, and bad inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nxdserve import model_files
from nxdserve.errors import ConfigError
from nxdserve.model_files import COMPLETE_MARKER, load_hf_config, resolve_model


@pytest.fixture(scope="module")
def default_path() -> Path:
    return resolve_model(None, progress=False)


def test_default_model_is_a_complete_hf_folder(default_path: Path) -> None:
    from transformers import AutoTokenizer

    for name in ("config.json", "tokenizer.json", "generation_config.json", COMPLETE_MARKER):
        assert (default_path / name).is_file(), name
    # the weights: one safetensors shard per decoder layer (gguf_dense.py), listed in the usual index
    index = json.loads((default_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {default_path / f for f in index.values()} == set(default_path.glob("*.safetensors"))
    assert default_path == model_files.cache_dir() / "models" / "SmolLM2-135M-Instruct"
    config = load_hf_config(default_path)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.tie_word_embeddings
    assert "quantization_config" not in json.loads((default_path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(default_path), local_files_only=True)
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2
    assert json.loads((default_path / "generation_config.json").read_text())["eos_token_id"] == 2


def test_second_call_reuses_the_cache(default_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = default_path / COMPLETE_MARKER
    before = marker.stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("reconverted a cached model")

    monkeypatch.setattr(model_files, "_convert_gguf", fail)
    assert resolve_model(None) == default_path
    assert marker.stat().st_mtime_ns == before


def test_cached_fast_path_imports_no_conversion_machinery(default_path: Path) -> None:
    code = (
        "import sys; from nxdserve.model_files import resolve_model; resolve_model(None); "
        "bad = [m for m in ('gguf', 'transformers', 'filelock') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_local_folder_is_used_as_is(default_path: Path) -> None:
    assert resolve_model(str(default_path)) == default_path.resolve()


@pytest.mark.parametrize("name", ["/no/such/model/dir", "nobody-org/no-such-model-xyz", "not a path or id"])
def test_unknown_model_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="not found"):
        resolve_model(name)


def test_folder_without_config_or_weights_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="Cannot read the model config"):
        load_hf_config(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ConfigError, match="neither"):
        resolve_model(str(other))


# -- the conversion's locking and atomicity, with transformers' part replaced by a fast fake ------------


def _fake_writer(default_path: Path, calls: list[Path], delay: float = 0.0, fail: bool = False):  # type: ignore[no-untyped-def]
    def write(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        calls.append(out_dir)
        time.sleep(delay)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(default_path / name, out_dir / name)
        (out_dir / "model.safetensors").write_bytes(b"x")  # only its presence is checked
        if fail:
            raise RuntimeError("conversion crashed")

    return write


def test_concurrent_conversions_run_once(default_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NXDSERVE_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_write_hf_folder", _fake_writer(default_path, calls, delay=0.5))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(None, progress=False))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert results == [target] * 3
    assert len(calls) == 1 and calls[0] != target  # written elsewhere, then renamed into place
    assert (target / COMPLETE_MARKER).is_file()
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name] == []


def test_failed_conversion_leaves_nothing_behind(
    default_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NXDSERVE_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_write_hf_folder", _fake_writer(default_path, calls, fail=True))
    with pytest.raises(RuntimeError, match="crashed"):
        resolve_model(None, progress=False)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []
    # An incomplete folder (no marker, e.g. from an older crash) is replaced by the next conversion.
    stale = tmp_path / "models" / "SmolLM2-135M-Instruct"
    stale.mkdir()
    (stale / "junk").write_text("")
    monkeypatch.setattr(model_files, "_write_hf_folder", _fake_writer(default_path, calls))
    assert resolve_model(None, progress=False) == stale
    assert not (stale / "junk").exists() and (stale / COMPLETE_MARKER).is_file()


@pytest.mark.slow
def test_real_conversion_into_a_fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole GGUF -> HF conversion with transformers (about 20-30 s)."""
    import torch

    from nxdserve.engine.models import LlamaFamilyModel

    monkeypatch.setenv("NXDSERVE_CACHE_DIR", str(tmp_path))
    path = resolve_model(None, progress=False)
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert json.loads((path / COMPLETE_MARKER).read_text())["conversion_version"] == model_files.CONVERSION_VERSION
    model = LlamaFamilyModel.from_pretrained(path, torch.float32, torch.device("cpu"))
    assert model.vocab_size == 49152


def test_eos_token_ids_gathers_both_configs_and_the_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))

    class Tokenizer:
        eos_token_id = 7

    assert model_files.eos_token_ids(tmp_path, Tokenizer()) == {2, 3, 5, 7}
    assert model_files.eos_token_ids(tmp_path) == {2, 3, 5}
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    assert model_files.eos_token_ids(tmp_path) == {2, 3}
