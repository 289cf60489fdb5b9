"""--speculative-config parsing and startup validation: vLLM's keys, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from nxdserve.engine.speculative.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from nxdserve.errors import ConfigError

TARGET = SimpleNamespace(vocab_size=49152, hidden_size=576, num_hidden_layers=30)


def _draft_folder(root: Path, **config: object) -> str:
    settings = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "max_position_embeddings": 512,
                "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    settings.update(config)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(settings))
    (root / "model.safetensors").write_bytes(b"")
    return str(root)


def test_ngram_defaults_follow_vllm() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, '
                                    '"prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (2, 4, 2)
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"


@pytest.mark.parametrize(
    "config,message",
    [
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 32\]"),
        ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "must be in"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "at least 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "tree": 1}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "exactly one of 'model'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "eagle", "num_speculative_tokens": 2, "model": "/nonexistent/eagle"}, "no config.json"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"}, "does not exist"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "only apply to method"),
        ({"num_speculative_tokens": 2}, "'method' is required"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_configs_fail_with_a_clear_error(config: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(config)  # type: ignore[arg-type]


def test_self_draft_layers_must_be_fewer_than_the_targets() -> None:
    c = SpeculativeConfig.from_dict({"self_draft_layers": 4, "num_speculative_tokens": 3}, target_config=TARGET)
    assert c.method == "draft_model" and c.self_draft_layers == 4
    with pytest.raises(ConfigError, match="fewer than the target's 30 layers"):
        SpeculativeConfig.from_dict({"method": "draft_model", "self_draft_layers": 30, "num_speculative_tokens": 3},
                                    target_config=TARGET)


def test_draft_vocabulary_and_context_are_checked(tmp_path: Path) -> None:
    good = _draft_folder(tmp_path / "good")
    c = SpeculativeConfig.from_dict({"model": good, "num_speculative_tokens": 3}, target_config=TARGET,
                                    max_model_len=512)
    assert c.method == "draft_model"
    bad_vocab = _draft_folder(tmp_path / "vocab", vocab_size=32000)
    with pytest.raises(ConfigError, match="vocabulary of 32000 tokens but the target has 49152"):
        SpeculativeConfig.from_dict({"model": bad_vocab, "num_speculative_tokens": 3}, target_config=TARGET)
    with pytest.raises(ConfigError, match="supports 512 positions, fewer than max_model_len=1024"):
        SpeculativeConfig.from_dict({"model": good, "num_speculative_tokens": 3}, target_config=TARGET,
                                    max_model_len=1024)


def test_eagle_head_is_detected_and_checked(tmp_path: Path) -> None:
    head = _draft_folder(tmp_path / "head", hidden_size=576, num_hidden_layers=1, max_position_embeddings=8192,
                         eagle_config={"version": 1})
    c = SpeculativeConfig.from_dict({"model": head, "num_speculative_tokens": 3}, target_config=TARGET,
                                    max_model_len=2048)
    assert c.method == "eagle"
    other = _draft_folder(tmp_path / "other", hidden_size=64, eagle_config={"version": 1})
    with pytest.raises(ConfigError, match="hidden_size 64 but the target has 576"):
        SpeculativeConfig.from_dict({"method": "eagle", "model": other, "num_speculative_tokens": 3},
                                    target_config=TARGET)
