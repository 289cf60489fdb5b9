"""Startup: find the model files, load the tokenizer and configs, resolve the engine config."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nxdserve.config import DEFAULT_CHUNKED_BATCHED_TOKENS, DEFAULT_CPU_CHUNKED_BATCHED_TOKENS, EngineConfig
from nxdserve.cpu_options import CpuOptions
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# --override-generation-config keys: the sampling defaults, and the default length under either name.
_OVERRIDE_KEYS = frozenset({*_GENERATION_DEFAULT_KEYS, "max_new_tokens", "max_tokens"})


@dataclass
class ModelFiles:
    path: Path
    tokenizer: Any
    hf_config: Any
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    generation_eos_ids: list[int] = field(default_factory=list)


def load_model_files(config: EngineConfig) -> ModelFiles:
    from transformers import AutoTokenizer

    from nxdserve.model_files import eos_token_ids, load_hf_config, resolve_model

    path = Path(resolve_model(config.model, revision=config.revision, download_dir=config.download_dir))
    tokenizer_path = path
    if config.tokenizer:
        tokenizer_path = Path(
            resolve_model(
                config.tokenizer,
                revision=config.tokenizer_revision,
                download_dir=config.download_dir,
                require_weights=False,
            )
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad folder
        raise ConfigError(f"cannot load a tokenizer from {tokenizer_path}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"the tokenizer at {tokenizer_path} has no fast (tokenizers) backend")
    hf_config = load_hf_config(path)
    eos_ids = sorted(eos_token_ids(path))  # the core adds the tokenizer's and the backend's
    defaults = generation_defaults(config, path)
    return ModelFiles(path, tokenizer, hf_config, defaults, eos_ids)


def generation_defaults(config: EngineConfig, model_path: Path) -> dict[str, float | int]:
    """The sampling defaults a request's omitted fields take, as vLLM derives them: the generation config's
    (``auto``: the model's generation_config.json; a folder: its generation_config.json; ``vllm``: none),
    then --override-generation-config merged on top. Logged when there are any."""
    source = {"auto": model_path, "vllm": None}.get(config.generation_config, Path(config.generation_config))
    defaults: dict[str, float | int] = {}
    if source is not None:
        gen_file = Path(source) / "generation_config.json"
        if gen_file.is_file():
            gen = json.loads(gen_file.read_text())
            defaults = {k: gen[k] for k in _GENERATION_DEFAULT_KEYS if gen.get(k) is not None}
            if gen.get("max_new_tokens") is not None:
                defaults["max_tokens"] = gen["max_new_tokens"]
        elif config.generation_config != "auto":
            raise ConfigError(f"--generation-config {config.generation_config}: no generation_config.json there.")
    overrides = dict(config.override_generation_config or {})
    unknown = sorted(set(overrides) - _OVERRIDE_KEYS)
    if unknown:
        raise ConfigError(
            f"--override-generation-config: unsupported keys {unknown}; supported: {sorted(_OVERRIDE_KEYS)}."
        )
    if "max_new_tokens" in overrides:
        overrides["max_tokens"] = overrides.pop("max_new_tokens")
    defaults.update(overrides)
    if defaults:
        logger.info(
            "default sampling parameters (generation config %s%s): %s",
            config.generation_config,
            " + --override-generation-config" if overrides else "",
            defaults,
        )
    return defaults


def max_positions(hf_config: Any) -> int | None:
    text_config = getattr(hf_config, "text_config", None) or hf_config
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if value else None


def torch_on_cpu(config: EngineConfig) -> bool:
    """Whether the engine will run the torch backend on a CPU."""
    import torch

    from nxdserve.engine.backends import nxd_status

    if config.backend == "nxd" or (config.backend == "auto" and nxd_status()[0]):
        return False
    return not (config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available()))


def unused_cpu_switches(config: EngineConfig, on_cpu: bool) -> list[str]:
    """The CPU options (``--cpu-*`` flags) set away from their defaults where no CPU kernel will read them: the
    nxd backend (NeuronCores) and the torch backend on CUDA. The loader logs them rather than refusing, as it does
    for the KV sizing flags the nxd backend has no use for."""
    if on_cpu:
        return []
    defaults = CpuOptions()
    return [f.name for f in fields(CpuOptions) if getattr(config.cpu, f.name) != getattr(defaults, f.name)]


def default_chunked_budget(config: EngineConfig) -> int:
    """The chunked-mode step budget when none is given: smaller where the torch backend runs on a CPU."""
    return DEFAULT_CPU_CHUNKED_BATCHED_TOKENS if torch_on_cpu(config) else DEFAULT_CHUNKED_BATCHED_TOKENS


def size_kv_cache(config: EngineConfig, files: ModelFiles) -> None:
    """Lower max_num_seqs to the KV slots that fit the space the flags give (engine.kv_sizing)."""
    from nxdserve.engine.backends import nxd_status
    from nxdserve.engine.kv_sizing import fit_slots, kv_budget, kv_bytes_per_slot, kv_element_bytes

    asked = config.gpu_memory_utilization is not None or config.kv_cache_memory_bytes is not None
    if config.backend == "nxd" or (config.backend == "auto" and nxd_status()[0]):
        if asked:
            logger.info("the nxd backend compiles its KV cache for --max-num-seqs x --max-model-len; "
                        "--gpu-memory-utilization / --kv-cache-memory-bytes do not change it")  # fmt: skip
        return
    from nxdserve.engine.models import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    budget = kv_budget(config, device.type, files.path)
    if budget is None:
        return
    assert config.max_model_len is not None
    dtype_bytes = kv_element_bytes(config.kv_cache_dtype, resolve_dtype(config.dtype, device, config.cpu.isa).itemsize)
    fit_slots(config, budget, kv_bytes_per_slot(files.hf_config, config.max_model_len, dtype_bytes),
              kv_cache_dtype=config.kv_cache_dtype)  # fmt: skip


def build_engine_core(config: EngineConfig, with_metrics: bool = True) -> tuple[Any, ModelFiles]:
    """Load everything and return a ready EngineCore (synchronous; used by AsyncEngine and tests)."""
    from nxdserve.engine.backends import create_backend
    from nxdserve.engine.core import EngineCore
    from nxdserve.engine.metrics import EngineMetrics

    files = load_model_files(config)
    on_cpu = torch_on_cpu(config)
    unused = unused_cpu_switches(config, on_cpu)
    if unused:
        logger.warning("CPU options %s have no effect: they configure the torch backend's CPU kernels, and this "
                       "engine does not run on the CPU", ", ".join(unused))  # fmt: skip
    budget = DEFAULT_CPU_CHUNKED_BATCHED_TOKENS if on_cpu else DEFAULT_CHUNKED_BATCHED_TOKENS
    config.resolve(max_positions(files.hf_config), chunked_token_budget=budget, on_cpu=on_cpu)
    size_kv_cache(config, files)
    backend = create_backend(config, files.path)
    extra = set(files.generation_eos_ids)
    name = config.served_model_name[0] if config.served_model_name else (config.model or files.path.name)
    metrics = EngineMetrics(name) if with_metrics else None
    proposer = None
    method = (config.speculative_config or {}).get("method")
    if config.speculative_config and method not in backend.capabilities.fused_spec_methods:
        from nxdserve.engine.speculative import create_proposer

        proposer = create_proposer(config, backend, files)
    core = EngineCore(config, backend, files.tokenizer, metrics, proposer)
    core.eos_token_ids = core.eos_token_ids | frozenset(extra)
    return core, files
