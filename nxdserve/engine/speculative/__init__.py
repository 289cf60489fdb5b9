"""Speculative decoding: proposers that draft tokens for the backend to verify in the target's forward.

``create_proposer`` is what the loader calls when ``--speculative-config`` is set. Methods:
- ``ngram``: prompt lookup over each request's own tokens (``ngram.py``);
- ``draft_model``: a small Llama-family model sharing the tokenizer, or the target's first N layers
  (``self_draft_layers``), with its own slot KV cache (``draft_model.py``);
- ``eagle``: an EAGLE-1 head over the target's hidden states (``eagle.py``; train one with
  ``nxdserve train-eagle``).
Every proposer drafts greedily (point proposals), so verification is lossless: greedy output is
exactly the target's, and sampled output has exactly the target's distribution.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from nxdserve.config import EngineConfig
from nxdserve.engine.speculative.base import SpeculativeProposer
from nxdserve.engine.speculative.config import SpeculativeConfig
from nxdserve.errors import ConfigError

if TYPE_CHECKING:  # the factory is handed the backend; proposers themselves never see it
    from nxdserve.engine.backends.base import Backend

logger = logging.getLogger(__name__)

__all__ = ["SpeculativeConfig", "SpeculativeProposer", "create_proposer"]


def create_proposer(config: EngineConfig, backend: Backend, files: Any) -> SpeculativeProposer | None:
    """The engine-side proposer for ``config.speculative_config``, or None when the backend runs the
    method itself (NxD fused speculation). Raises ConfigError for a config that cannot work."""
    assert config.speculative_config is not None and config.max_model_len is not None
    caps = backend.capabilities
    max_model_len = min(config.max_model_len, caps.max_model_len)
    spec = SpeculativeConfig.from_dict(
        config.speculative_config, target_config=files.hf_config, max_model_len=max_model_len
    )
    if spec.method in caps.fused_spec_methods:
        logger.info("speculation: %s runs fused inside the %s backend", spec.method, backend.name)
        return None
    if not caps.supports_draft_verification:
        raise ConfigError(
            f"--speculative-config method {spec.method!r}: the {backend.name} backend cannot verify engine "
            f"drafts (it runs {sorted(caps.fused_spec_methods) or 'no methods'} itself)."
        )
    if spec.method == "eagle3":
        raise ConfigError("--speculative-config method 'eagle3' runs only fused on the nxd backend; use 'eagle' here.")
    num_slots = min(config.max_num_seqs, caps.max_num_seqs)
    proposer: SpeculativeProposer
    if spec.method == "ngram":
        from nxdserve.engine.speculative.ngram import NgramProposer

        proposer = NgramProposer(spec, max_model_len)
    else:
        target = _torch_target(backend, spec.method)
        if spec.method == "draft_model":
            from nxdserve.engine.speculative.draft_model import DraftModelProposer, truncated_model

            if spec.self_draft_layers is not None:
                draft = truncated_model(target, files.hf_config, spec.self_draft_layers)
                proposer = DraftModelProposer(spec, max_model_len, num_slots, draft)
            else:
                from nxdserve.model_files import resolve_model

                assert spec.model is not None
                proposer = DraftModelProposer.from_path(
                    spec, max_model_len, num_slots, resolve_model(spec.model), _draft_dtype(spec, target),
                    target.device,
                )
        else:
            from nxdserve.engine.speculative.eagle import EagleProposer
            from nxdserve.engine.speculative.eagle_head import load_eagle_head

            assert spec.model is not None
            head = load_eagle_head(spec.model, _draft_dtype(spec, target), target.device, max_model_len)
            proposer = EagleProposer(spec, max_model_len, num_slots, head, target)
            if not caps.draft_alternatives:
                proposer.num_alternatives = 0
            backend.keep_hidden_states = True  # type: ignore[attr-defined]
    device = getattr(getattr(backend, "device", None), "type", "cpu")
    if device != "cpu":  # the policies' CPU clock would miss asynchronous accelerator work
        proposer.set_policy_clock(time.perf_counter)
    logger.info(
        "speculation: %s, k=%d%s", spec.method, spec.num_speculative_tokens,
        f", drafting only while <= {spec.disable_by_batch_size} requests decode"
        if spec.disable_by_batch_size is not None else ", on/off by batch size from measured step costs",
    )
    return proposer


def _torch_target(backend: Backend, method: str) -> Any:
    runner = getattr(backend, "runner", None)
    model = getattr(runner, "model", None)
    if model is None or not hasattr(backend, "keep_hidden_states"):
        raise ConfigError(f"--speculative-config method {method!r} needs the torch backend's model.")
    return model


def _draft_dtype(spec: SpeculativeConfig, target: Any) -> Any:
    if spec.draft_dtype is None:
        return target.dtype
    from nxdserve.engine.models import resolve_dtype

    return resolve_dtype(spec.draft_dtype, target.device)
