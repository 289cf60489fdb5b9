"""NeuronConfig / InferenceConfig from an EngineConfig, the model class, and the artifact-cache key.

The defaults follow the official vLLM plugin (vllm-neuron 0.5, ``_get_default_neuron_config``):
tp_degree = --tensor-parallel-size, batch_size = max_num_seqs, ctx_batch_size = 1,
seq_len = max_context_length = max_model_len, continuous batching, bucketing, right padding and
dynamic on-device sampling. ``--override-neuron-config`` is merged on top (dicts one level deep, so
``{"on_device_sampling_config": {"global_topk": 64}}`` keeps ``dynamic``; ``null`` switches on-device
sampling off). Nothing in this module imports NxD: it produces plain keyword dicts, so it is
testable anywhere; ``app.py`` turns them into NxD objects.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

# Bumped when what nxdserve writes into an artifact folder changes, so stale folders are not reused.
ARTIFACT_FORMAT_VERSION = 1
# Root of nxdserve's own artifact cache (one sub-folder per config hash).
ARTIFACTS_ROOT_ENV = "NXDSERVE_NEURON_ARTIFACTS"
# vllm-neuron's variable: the exact folder of one compiled model, used as is (load, else compile there).
COMPILED_ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"

DEFAULT_GLOBAL_TOPK = 256  # OnDeviceSamplingConfig's default
# Speculation methods NxD runs fused on device (the draft or EAGLE head is compiled in).
FUSED_METHODS = frozenset({"draft_model", "eagle", "eagle3"})
# Layouts this backend does not drive: it owns contiguous KV lines (slot = seq_id).
UNSUPPORTED_OVERRIDES = ("is_block_kv_layout", "is_prefix_caching", "chunked_prefill_config", "async_mode")


def neuron_dtype(dtype: str) -> str:
    """``auto`` is bfloat16 on Neuron (NxD's default and the devices' native type)."""
    return "bfloat16" if dtype == "auto" else dtype


def default_neuron_config(config: EngineConfig) -> dict[str, Any]:
    assert config.max_model_len is not None, "resolve the EngineConfig first"
    max_len = config.max_model_len
    kwargs: dict[str, Any] = {
        "tp_degree": config.tensor_parallel_size,
        "batch_size": config.max_num_seqs,
        "ctx_batch_size": 1,  # context encoding: one prompt per call
        "seq_len": max_len,
        "max_context_length": max_len,
        "enable_bucketing": True,
        "is_continuous_batching": config.max_num_seqs > 1,
        "padding_side": "right",
        "torch_dtype": neuron_dtype(config.dtype),
        "on_device_sampling_config": {
            "dynamic": True,  # per-row [top_k, top_p, temperature] take effect
            "deterministic": False,
            "global_topk": DEFAULT_GLOBAL_TOPK,
        },
    }
    if config.enable_lora:
        kwargs["lora_config"] = lora_serving_config(config)
    kwargs.update(kv_cache_quant_config(config))
    spec = config.speculative_config
    if spec and spec.get("method") in FUSED_METHODS:
        method = spec["method"]
        # Our num_speculative_tokens counts drafts (vLLM's meaning); NxD's speculation_length counts
        # verified positions, the input token plus the drafts.
        kwargs["speculation_length"] = int(spec["num_speculative_tokens"]) + 1
        kwargs["enable_fused_speculation"] = True
        if method in ("eagle", "eagle3"):
            kwargs["enable_eagle_speculation"] = True
            kwargs["is_eagle3"] = method == "eagle3"
    return kwargs


# --kv-cache-dtype -> KVQuantizationConfig.quant_dtype (neuronx_distributed.quantization.quantization_config).
KV_QUANT_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_cache_quant_config(config: EngineConfig) -> dict[str, Any]:
    """NeuronConfig keywords for an fp8 ``--kv-cache-dtype``: ``kv_cache_quant`` (NxD's fp8 compiler switch) and
    ``kv_quant_config`` (read by KVCacheManager: ``quant_dtype`` is the cache's dtype; ``direct_cast`` stores
    ``x.to(quant_dtype)``, i.e. scale 1.0, vLLM's default). Empty for ``auto``. NxD has no calibration pass (its
    non-direct-cast scales are static buffers), so ``--calculate-kv-scales`` is refused."""
    if config.kv_cache_dtype == "auto":
        return {}
    if config.kv_cache_dtype not in KV_QUANT_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {config.kv_cache_dtype!r}: the nxd backend maps fp8, fp8_e4m3, fp8_e5m2.")
    if config.calculate_kv_scales:
        raise ConfigError(
            "--calculate-kv-scales: NxD Inference has no calibration pass (its KV scales are static buffers of "
            "the compiled model, 1.0 unless a checkpoint gives them); drop the flag on the nxd backend or use "
            "--backend torch. See docs/neuron.md."
        )
    import torch  # NxD's KVQuantizationConfig takes a torch dtype

    quant_dtype = getattr(torch, KV_QUANT_DTYPES[config.kv_cache_dtype])
    return {"kv_cache_quant": True, "kv_quant_config": {"quant_dtype": quant_dtype, "direct_cast": True}}


def lora_serving_config(config: EngineConfig) -> dict[str, Any]:
    """NxD's LoraServingConfig keywords (modules/lora_serving/config.py, NxDI 0.9). NxD builds its LoRA
    weights into the compiled model: only the --lora-modules adapters, known at compile time, can be served
    (static multi-LoRA); a zero adapter at index 0 (``enable_base_model_only``) serves base-model rows."""
    modules = list(config.lora_modules)
    if not modules:
        raise ConfigError(
            "--enable-lora on the nxd backend needs its adapters at compile time: pass them with --lora-modules "
            "(NxD compiles LoRA weights into the model; adapters added at run time are a torch-backend feature)."
        )
    if len(modules) > config.max_loras:
        raise ConfigError(
            f"the nxd backend keeps every adapter on device: --max-loras ({config.max_loras}) must be at least "
            f"the number of --lora-modules ({len(modules)})"
        )
    targets: set[str] = set()
    for module in modules:
        try:
            adapter_config = json.loads((Path(module.lora_path) / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--lora-modules {module.lora_name}: unreadable adapter_config.json: {exc}") from exc
        found = adapter_config.get("target_modules") or []
        targets.update([found] if isinstance(found, str) else found)
    return {
        "max_loras": config.max_loras,
        "max_lora_rank": config.max_lora_rank,
        "max_cpu_loras": config.max_cpu_loras or config.max_loras,
        "batch_size": config.max_num_seqs,
        "target_modules": sorted(targets),
        "lora_ckpt_paths": {module.lora_name: module.lora_path for module in modules},
        "dynamic_multi_lora": False,
        "enable_base_model_only": True,
    }


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(target kwargs, draft-only overrides). ``draft_overrides`` applies to the fused draft only."""
    merged = copy.deepcopy(base)
    overrides = copy.deepcopy(overrides or {})
    draft_overrides = overrides.pop("draft_overrides", None) or {}
    check_supported(overrides, "--override-neuron-config")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged, draft_overrides


def check_supported(settings: Any, where: str) -> None:
    """Refuse layouts this backend does not drive (``settings``: kwargs dict or a NeuronConfig)."""
    for key in UNSUPPORTED_OVERRIDES:
        value = settings.get(key) if isinstance(settings, dict) else getattr(settings, key, None)
        if value:
            raise ConfigError(
                f"{where}: {key} is not supported by nxdserve's NxD backend, which drives the contiguous KV "
                "layout (one KV line per slot = seq_id) synchronously. See docs/neuron.md."
            )


def draft_neuron_config(target: dict[str, Any], draft_overrides: dict[str, Any]) -> dict[str, Any]:
    """The fused draft's kwargs, as vllm-neuron derives them from the target's."""
    draft = copy.deepcopy(target)
    draft.pop("lora_config", None)  # drafts run the base model; the target verifies with the adapter
    draft["enable_fused_speculation"] = False
    if not draft.get("enable_eagle_speculation"):
        draft["speculation_length"] = 0
    else:
        draft["is_eagle_draft"] = True
    draft.update(draft_overrides)
    return draft


@dataclass(frozen=True)
class NxdSettings:
    """What the backend needs to know about the neuron config it runs (read back after building)."""

    batch_size: int  # token-generation batch: the KV lines decoded each step
    max_context_length: int
    max_length: int
    cte_buckets_largest: int
    on_device_sampling: bool
    global_topk: int | None
    output_logits: bool
    speculation_length: int  # 0 unless fused speculation
    eagle: bool
    seq_ids_mask: bool
    pad_token_id: int

    @classmethod
    def from_neuron_config(cls, nc: Any, pad_token_id: int) -> NxdSettings:
        odsc = nc.on_device_sampling_config
        buckets = getattr(nc, "context_encoding_buckets", None) if nc.enable_bucketing else None
        return cls(
            batch_size=int(nc.tkg_batch_size),
            max_context_length=int(nc.max_context_length),
            max_length=int(nc.max_length),
            cte_buckets_largest=int(buckets[-1]) if buckets else int(nc.max_context_length),
            on_device_sampling=odsc is not None,
            global_topk=int(odsc.global_topk) if odsc is not None else None,
            output_logits=bool(nc.output_logits),
            speculation_length=int(nc.speculation_length) if nc.enable_fused_speculation else 0,
            eagle=bool(nc.enable_eagle_speculation),
            seq_ids_mask=bool(getattr(nc, "apply_seq_ids_mask", False)),
            pad_token_id=pad_token_id,
        )

    @property
    def fused(self) -> bool:
        return self.speculation_length > 0

    @property
    def max_model_len(self) -> int:
        """The longest request that never reaches a bucket ValueError mid-request.

        A fused step at input position p needs ``p + speculation_length <= max_length`` and there is no
        plain token-generation model to fall back on (NxD compiles the fused model instead of it). The
        last step of a request of total length N has p = N - 2, so N <= max_length - k + 2.
        """
        if self.speculation_length >= 2:
            return self.max_length - self.speculation_length + 2
        return self.max_length

    @property
    def sampling_mode(self) -> str:
        """device: tokens only; hybrid: tokens + logits (CPU sampling where needed); cpu: logits only."""
        if not self.on_device_sampling:
            return "cpu"
        return "hybrid" if self.output_logits and not self.fused else "device"


# -- model class -----------------------------------------------------------------------------------------

_SPECIAL_KEYS = {"gptoss": "gpt_oss", "qwen3moe": "qwen3_moe", "qwen2vl": "qwen2_vl", "qwen3vl": "qwen3_vl"}


def model_type_key(architecture: str) -> tuple[str, str]:
    """HF architecture -> (MODEL_TYPES key, task), by vllm-neuron's rule: split on "For", lowercase
    the model name, kebab-case the task ("ConditionalGeneration" counts as "CausalLM")."""
    if architecture == "LlavaForConditionalGeneration":
        return "pixtral", "causal-lm"
    name, sep, task = architecture.partition("For")
    if not sep:
        raise ConfigError(f"Cannot read a model type from the architecture name {architecture!r}.")
    task = "CausalLM" if task == "ConditionalGeneration" else task
    # CamelCase -> kebab-case, keeping acronyms together: CausalLM -> causal-lm, ImageEncoding -> image-encoding.
    kebab = re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", re.sub(r"(.)([A-Z][a-z]+)", r"\1-\2", task)).lower()
    key = name.lower()
    return _SPECIAL_KEYS.get(key, key), kebab


def pick_model_class(hf_config: Any, model_types: dict[str, dict[str, Any]]) -> Any:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    tried = []
    for arch in architectures:
        if "For" not in arch:  # e.g. GPT2LMHeadModel: no task in the name
            tried.append(arch)
            continue
        key, task = model_type_key(arch)
        tried.append(f"{arch} -> {key}/{task}")
        if task in model_types.get(key, {}):
            return model_types[key][task]
    model_type = getattr(hf_config, "model_type", None)  # checkpoints without architectures
    if model_type in model_types and "causal-lm" in model_types[model_type]:
        return model_types[model_type]["causal-lm"]
    raise ConfigError(
        f"NxD Inference has no causal-LM class for this model ({', '.join(tried) or model_type!r}); "
        f"supported model types: {', '.join(sorted(model_types))}. Use --backend torch."
    )


def refuse_image_to_text(cls: Any, hf_config: Any) -> None:
    """Refuse, at start-up, the vision-language applications this backend does not drive end to end.

    NxDI's image-to-text applications (Llama 4, Pixtral, Qwen2-VL, Qwen3-VL, Mllama, ...) build their
    InferenceConfig from ``text_neuron_config`` and ``vision_neuron_config`` and take image tensors in
    ``forward``; the backend builds one NeuronConfig and passes token ids only, so without this check
    those checkpoints die in NxD with a TypeError, or would run with their images silently dropped.
    """
    config_cls = cls.get_config_cls()
    takes_two_configs = "text_neuron_config" in inspect.signature(config_cls.__init__).parameters
    image_to_text_app = any(base.__name__ == "NeuronBaseForImageToText" for base in inspect.getmro(cls))
    vision_checkpoint = getattr(hf_config, "vision_config", None) is not None
    if takes_two_configs or image_to_text_app or vision_checkpoint:
        archs = ", ".join(getattr(hf_config, "architectures", None) or []) or str(getattr(hf_config, "model_type", ""))
        raise ConfigError(
            f"{archs} is a vision-language model ({cls.__name__}); nxdserve's NxD backend drives NxD Inference's "
            "text-only causal-LM applications and does not run its image-to-text applications yet "
            "(nor does the torch backend serve vision-language models yet). See docs/neuron.md."
        )


# -- artifact cache ----------------------------------------------------------------------------------------


def artifact_key(config_json: str, *extra: str) -> str:
    """Hash of the full InferenceConfig JSON plus the NxD version, model paths and our format."""
    h = hashlib.sha256()
    for part in (config_json, f"format={ARTIFACT_FORMAT_VERSION}", *extra):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def artifact_dir(model_path: Path, key: str) -> tuple[Path, bool]:
    """(folder, exact). ``exact`` is True for $NEURON_COMPILED_ARTIFACTS, a folder the user named."""
    exact = os.environ.get(COMPILED_ARTIFACTS_ENV)
    if exact:
        return Path(exact).expanduser(), True
    root_env = os.environ.get(ARTIFACTS_ROOT_ENV)
    if root_env:
        root = Path(root_env).expanduser()
    else:
        from nxdserve.model_files import cache_dir

        root = cache_dir() / "neuron-artifacts"
    return root / f"{model_path.name}-{key}", False
