"""``--speculative-config``: vLLM's JSON keys, validated once at startup with clear errors.

Accepted forms (vLLM's spelling)::

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/small-llama", "num_speculative_tokens": 4}
    {"method": "draft_model", "self_draft_layers": 6, "num_speculative_tokens": 3}   # nxdserve extra
    {"method": "eagle", "model": "/path/to/eagle-head", "num_speculative_tokens": 3}
    {"method": "eagle", "model": "/path/to/eagle-head", "num_speculative_tokens": 1, "draft_alternatives": 2}

``self_draft_layers`` builds the draft from the target's first N decoder layers plus its final norm
and LM head (no extra weights). ``disable_by_batch_size`` (vLLM V0's knob) turns drafting off while
more requests than that are decoding; left unset, it is derived from the backend's measured step
costs (see ``policy.py``). ``draft_alternatives`` (nxdserve extra, EAGLE only, default 2) verifies the
head's next-best guesses for the first draft beside it, in the same forward (``eagle.py``).

Checks that need the target (vocabulary, context length, layer count) run in ``validate_target``;
``from_dict`` alone already catches everything the JSON itself gets wrong, so the CLI can call it
before loading any model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeGuard

from nxdserve.errors import ConfigError

Method = Literal["ngram", "draft_model", "eagle", "eagle3"]
# eagle3 is accepted for backends that run it fused (NxD); the torch backend has no EAGLE-3 proposer.
METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle", "eagle3")


def _is_method(value: object) -> TypeGuard[Method]:
    return value in METHODS
# vLLM's verifier handles at most 32 drafts per step (MAX_SPEC_LEN); more never pays anyway.
MAX_SPECULATIVE_TOKENS = 32
# vLLM's n-gram defaults when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# EAGLE's first draft also carries the head's next-best tokens as alternatives (see DraftAlternatives):
# the default and the most (each costs a token of the target's forward).
DEFAULT_EAGLE_ALTERNATIVES = 2
MAX_DRAFT_ALTERNATIVES = 7

_KEYS = frozenset(
    {
        "method",
        "model",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "self_draft_layers",
        "disable_by_batch_size",
        "draft_dtype",
        "draft_alternatives",
    }
)


def _spec_error(message: str) -> ConfigError:
    return ConfigError(f"--speculative-config: {message}")


def _int_field(d: dict[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _spec_error(f"{key} must be an integer, got {value!r}.")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise _spec_error(f"{key} must be {bound}, got {value}.")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: Method
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    self_draft_layers: int | None = None
    disable_by_batch_size: int | None = None  # None: derived from measured costs
    draft_dtype: str | None = None  # None: the target's dtype
    draft_alternatives: int = 0  # EAGLE: the head's next-best tokens verified beside its first draft

    @classmethod
    def from_dict(
        cls,
        d: dict[str, Any] | str,
        *,
        target_config: Any | None = None,
        max_model_len: int | None = None,
    ) -> SpeculativeConfig:
        """Parse and validate. ``d`` may be the JSON text itself. With ``target_config`` (the target's
        HF config) and ``max_model_len``, also run the checks that need the target."""
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as exc:
                raise _spec_error(f"not valid JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise _spec_error(f"expected a JSON object, got {type(d).__name__}.")
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise _spec_error(f"unknown key(s) {unknown}; known keys: {sorted(_KEYS)}.")

        method = d.get("method")
        if method is None:
            method = _infer_method(d)
        if not _is_method(method):
            raise _spec_error(f"method must be one of {list(METHODS)}, got {method!r}.")

        k = _int_field(d, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        if k is None:
            raise _spec_error("num_speculative_tokens is required.")

        lookup_min = _int_field(d, "prompt_lookup_min", 1)
        lookup_max = _int_field(d, "prompt_lookup_max", 1)
        if method == "ngram":
            if lookup_min is None and lookup_max is None:
                lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
            elif lookup_min is None:
                lookup_min = lookup_max
            elif lookup_max is None:
                lookup_max = lookup_min
            assert lookup_min is not None and lookup_max is not None
            if lookup_min > lookup_max:
                raise _spec_error(
                    f"prompt_lookup_min ({lookup_min}) must not exceed prompt_lookup_max ({lookup_max})."
                )
        elif lookup_min is not None or lookup_max is not None:
            raise _spec_error(f"prompt_lookup_min/max only apply to method 'ngram', not {method!r}.")

        model = d.get("model")
        if model == "[ngram]":  # vLLM's legacy spelling of the n-gram method
            model = None
        if model is not None and not isinstance(model, str):
            raise _spec_error(f"model must be a path string, got {model!r}.")
        self_layers = _int_field(d, "self_draft_layers", 1)
        if method == "ngram" and (model is not None or self_layers is not None):
            raise _spec_error("method 'ngram' takes no model or self_draft_layers.")
        if method == "draft_model" and (model is None) == (self_layers is None):
            raise _spec_error(
                "method 'draft_model' needs exactly one of 'model' (a draft checkpoint sharing the target's "
                "tokenizer) or 'self_draft_layers' (draft = the target's first N layers)."
            )
        if method in ("eagle", "eagle3"):
            if model is None:
                raise _spec_error(
                    "method 'eagle' needs 'model': an EAGLE head folder (train one with "
                    "`nxdserve train-eagle --model M --out DIR`)."
                )
            if self_layers is not None:
                raise _spec_error("self_draft_layers only applies to method 'draft_model'.")

        draft_dtype = d.get("draft_dtype")
        if draft_dtype is not None and draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise _spec_error(f"draft_dtype must be auto, float32, bfloat16 or float16, got {draft_dtype!r}.")

        alternatives = _int_field(d, "draft_alternatives", 0, MAX_DRAFT_ALTERNATIVES)
        if alternatives and method != "eagle":
            raise _spec_error(f"draft_alternatives only applies to method 'eagle', not {method!r}.")
        if alternatives is None:
            alternatives = DEFAULT_EAGLE_ALTERNATIVES if method == "eagle" else 0

        config = cls(
            method=method,
            num_speculative_tokens=k,
            model=model,
            prompt_lookup_min=lookup_min if lookup_min is not None else DEFAULT_PROMPT_LOOKUP,
            prompt_lookup_max=lookup_max if lookup_max is not None else DEFAULT_PROMPT_LOOKUP,
            self_draft_layers=self_layers,
            disable_by_batch_size=_int_field(d, "disable_by_batch_size", 1),
            draft_dtype=None if draft_dtype in (None, "auto") else draft_dtype,
            draft_alternatives=alternatives,
        )
        if model is not None:
            config._check_model_folder()
        if target_config is not None:
            config.validate_target(target_config, max_model_len)
        return config

    # -- checks against files and the target ---------------------------------------------------------
    def _check_model_folder(self) -> None:
        assert self.model is not None
        path = Path(self.model).expanduser()
        if self.method in ("eagle", "eagle3"):
            if not (path / "config.json").is_file():
                raise _spec_error(f"EAGLE head folder {self.model!r} has no config.json.")
            if not list(path.glob("*.safetensors")):
                raise _spec_error(f"EAGLE head folder {self.model!r} has no .safetensors weights.")
        elif not path.exists():
            raise _spec_error(f"draft model {self.model!r} does not exist (it must be a local folder or .gguf).")

    def validate_target(self, target_config: Any, max_model_len: int | None) -> None:
        """Vocabulary, context length and layer checks against the target's HF config."""
        target = getattr(target_config, "text_config", None) or target_config
        target_vocab = int(target.vocab_size)
        if self.method == "draft_model" and self.self_draft_layers is not None:
            num_layers = int(target.num_hidden_layers)
            if self.self_draft_layers >= num_layers:
                raise _spec_error(
                    f"self_draft_layers={self.self_draft_layers} must be fewer than the target's "
                    f"{num_layers} layers (a full-depth self-draft is the target itself)."
                )
            return
        if self.model is None:
            return
        draft = self.draft_hf_config()
        draft_vocab = int(getattr(draft, "vocab_size", 0) or 0)
        if draft_vocab != target_vocab:
            raise _spec_error(
                f"the draft {self.model!r} has a vocabulary of {draft_vocab} tokens but the target has "
                f"{target_vocab}; a draft must share the target's tokenizer."
            )
        if self.method in ("eagle", "eagle3") and int(draft.hidden_size) != int(target.hidden_size):
            raise _spec_error(
                f"the EAGLE head {self.model!r} has hidden_size {draft.hidden_size} but the target has "
                f"{target.hidden_size}; it was trained for another model."
            )
        draft_max = getattr(draft, "max_position_embeddings", None)
        if max_model_len is not None and draft_max is not None and int(draft_max) < max_model_len:
            # vLLM PR #22935: a shorter draft context reads out of bounds near the end; refuse at startup.
            raise _spec_error(
                f"the draft {self.model!r} supports {draft_max} positions, fewer than max_model_len="
                f"{max_model_len}; lower --max-model-len or use a draft with a longer context."
            )

    def draft_hf_config(self) -> Any:
        """The draft's HF config (draft_model or eagle with a model folder)."""
        assert self.model is not None
        if self.method in ("eagle", "eagle3"):
            from transformers import LlamaConfig

            try:
                return LlamaConfig.from_pretrained(str(Path(self.model).expanduser()))
            except Exception as exc:  # transformers raises OSError/ValueError variously
                raise _spec_error(f"cannot read the EAGLE head config in {self.model!r}: {exc}") from exc
        from nxdserve.model_files import load_hf_config, resolve_model

        return load_hf_config(resolve_model(self.model))


def _infer_method(d: dict[str, Any]) -> str:
    """vLLM infers the method from the model when it is left out; so do we, conservatively."""
    if d.get("self_draft_layers") is not None:
        return "draft_model"
    model = d.get("model")
    if model is None:
        raise _spec_error("'method' is required (ngram, draft_model or eagle).")
    if model == "[ngram]":  # vLLM's legacy spelling
        return "ngram"
    config_file = Path(str(model)).expanduser() / "config.json"
    if config_file.is_file():
        try:
            cfg = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError):
            cfg = {}
        if "eagle_config" in cfg or "eagle" in str(cfg.get("model_type", "")).lower():
            return "eagle"
    return "draft_model"
