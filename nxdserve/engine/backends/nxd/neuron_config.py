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
from nxdserve.errors import ConfigError, LoRAAdapterError
from nxdserve.lora.registry import check_lora_limits

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


# --quantization -> NxD Inference's weight quantization dtype (NeuronConfig.quantization_dtype; NxD's
# QuantizedDtype names). NxD quantizes a dense checkpoint itself, per output channel, symmetric.
NXD_QUANTIZATION_DTYPES = {"int8": "int8", "rtn-int8": "int8", "fp8": "f8e4m3"}
# The NeuronConfig keys that mapping sets (a fused draft does not inherit them: it would share the checkpoint).
QUANTIZATION_KEYS = (
    "quantized", "quantized_checkpoints_path", "quantization_type", "quantization_dtype", "modules_to_not_convert",
)  # fmt: skip


def neuron_dtype(dtype: str) -> str:
    """``auto`` is bfloat16 on Neuron (NxD's default and the devices' native type)."""
    return "bfloat16" if dtype == "auto" else dtype


def default_neuron_config(config: EngineConfig, model_path: Path | None = None) -> dict[str, Any]:
    """``model_path``: the checkpoint (names the quantized checkpoint with --quantization)."""
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
    if config.quantization is not None:
        kwargs.update(quantization_neuron_config(config, model_path))
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


def quantization_neuron_config(config: EngineConfig, model_path: Path | None) -> dict[str, Any]:
    """NxD's weight-quantization keys for ``--quantization`` (NxDI models/config.py NeuronConfig): per-channel
    symmetric int8 or f8e4m3 weights, the LM head left dense as the torch backend leaves it. NxD writes the
    quantized checkpoint itself (``save_quantized_state_dict``, before compiling) at
    ``quantized_checkpoints_path``: one file per model and format beside the compiled artifacts."""
    method = config.quantization
    dtype = NXD_QUANTIZATION_DTYPES.get(method or "")
    if dtype is None:
        instead = {
            "gguf": "serve the model's dense HF checkpoint with --quantization int8 or fp8 (NxD reads safetensors)",
            "compressed-tensors": "serve the dense checkpoint it was made from with --quantization int8 or fp8 "
            "(NxD quantizes per channel itself), or this one with --backend torch",
        }.get(method or "", "NxD Inference has no 4-bit weight format for these models: use --quantization int8 "
                            "or fp8 on nxd, or --backend torch for 4-bit")  # fmt: skip
        raise ConfigError(f"--quantization {method}: not available on the nxd backend; {instead}. See docs/neuron.md.")
    if model_path is None:
        raise ConfigError(f"--quantization {method} on nxd: the model path names the quantized checkpoint.")
    name = f"{model_path.name}-{hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:12]}"
    checkpoint = artifacts_root() / "quantized" / f"{name}-{dtype}-per_channel.pt"
    return {
        "quantized": True,
        "quantized_checkpoints_path": str(checkpoint),
        "quantization_type": "per_channel_symmetric",
        "quantization_dtype": dtype,
        "modules_to_not_convert": ["lm_head"],
    }


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
    """NxD's LoraServingConfig keywords (modules/lora_serving/config.py, NxDI 0.9; names checked in
    docs/neuron.md: ``max_cpu_loras``, not 0.2's ``max_loras_on_cpu``). NxD builds its LoRA
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
    try:  # before NxD compiles: its own failure on these would come from deep inside the build
        check_lora_limits(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
    except LoRAAdapterError as exc:
        raise ConfigError(exc.message) from exc
    targets: set[str] = set()
    for module in modules:
        try:
            adapter_config = json.loads((Path(module.lora_path) / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--lora-modules {module.lora_name}: unreadable adapter_config.json: {exc}") from exc
        rank = int(adapter_config.get("r", 0))
        if rank > config.max_lora_rank:
            raise ConfigError(
                f"--lora-modules {module.lora_name}: LoRA rank {rank} is greater than --max-lora-rank "
                f"{config.max_lora_rank} (NxD compiles its LoRA buffers at that rank)"
            )
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
    if not isinstance(draft_overrides, dict):
        raise ConfigError("--override-neuron-config: draft_overrides must be a JSON object.")
    check_supported(overrides, "--override-neuron-config")
    check_supported(draft_overrides, "--override-neuron-config draft_overrides")
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
    for key in QUANTIZATION_KEYS:  # the target's quantized checkpoint is the target's (draft_overrides may set)
        draft.pop(key, None)
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
    cte_buckets_largest: int  # the longest prompt one context encoding takes (<= max_context_length)
    tkg_buckets_largest: int  # the longest attention a decode step takes (<= max_length)
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
        # Custom buckets may stop below max_context_length / max_length (nxd-api.md 1.1): past the largest,
        # NxD raises "Input len ... exceeds largest bucket", so the largest are the limits
        buckets = getattr(nc, "context_encoding_buckets", None) if nc.enable_bucketing else None
        tkg_buckets = getattr(nc, "token_generation_buckets", None) if nc.enable_bucketing else None
        return cls(
            batch_size=int(nc.tkg_batch_size),
            max_context_length=int(nc.max_context_length),
            max_length=int(nc.max_length),
            cte_buckets_largest=int(buckets[-1]) if buckets else int(nc.max_context_length),
            tkg_buckets_largest=int(tkg_buckets[-1]) if tkg_buckets else int(nc.max_length),
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
        """The longest request that never reaches a bucket ValueError mid-request: the largest token-generation
        bucket (``max_length`` unless the buckets stop below it).

        A fused step at input position p needs ``p + speculation_length <= that bucket`` and there is no
        plain token-generation model to fall back on (NxD compiles the fused model instead of it). The
        last step of a request of total length N has p = N - 2, so N <= bucket - k + 2.
        """
        if self.speculation_length >= 2:
            return self.tkg_buckets_largest - self.speculation_length + 2
        return self.tkg_buckets_largest

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


# The image-to-text applications this backend drives end to end (HF model_type -> NxDI MODEL_TYPES key).
DRIVEN_IMAGE_TO_TEXT = frozenset({"qwen2_vl"})
# Qwen2-VL's vision encoder is compiled for one image size (Qwen2VLNeuronConfig's default_image_width/height,
# NxDI qwen2_vl/utils/constants.py): every image must have that size's patch grid.
QWEN2_VL_DEFAULT_IMAGE_SIZE = (640, 320)  # (width, height)
VISION_OVERRIDES_KEY = "vision_neuron_config"  # --override-neuron-config's key for the vision NeuronConfig


def is_image_to_text(cls: Any, hf_config: Any) -> bool:
    """NxDI's vision-language applications build their InferenceConfig from ``text_neuron_config`` and
    ``vision_neuron_config`` and take image tensors in ``forward``."""
    config_cls = cls.get_config_cls()
    takes_two_configs = "text_neuron_config" in inspect.signature(config_cls.__init__).parameters
    image_to_text_app = any(base.__name__ == "NeuronBaseForImageToText" for base in inspect.getmro(cls))
    vision_checkpoint = getattr(hf_config, "vision_config", None) is not None
    return takes_two_configs or image_to_text_app or vision_checkpoint


def refuse_image_to_text(cls: Any, hf_config: Any) -> None:
    """Refuse, at start-up, the vision-language applications this backend does not drive end to end.

    Qwen2-VL runs (``DRIVEN_IMAGE_TO_TEXT``); Llama 4, Pixtral, Qwen3-VL, Mllama, Gemma 3 take other image
    inputs (``vision_mask``, cross-attention states, deepstack embeddings) the backend does not pass, so
    without this check they would die in NxD or run with their images silently dropped.
    """
    if not is_image_to_text(cls, hf_config) or getattr(hf_config, "model_type", None) in DRIVEN_IMAGE_TO_TEXT:
        return
    archs = ", ".join(getattr(hf_config, "architectures", None) or []) or str(getattr(hf_config, "model_type", ""))
    raise ConfigError(
        f"{archs} is a vision-language model ({cls.__name__}); nxdserve's NxD backend drives NxD Inference's "
        "text-only causal-LM applications and, of its image-to-text applications, Qwen2-VL only. "
        "Use --backend torch for this model. See docs/neuron.md."
    )


def image_to_text_refusals(config: EngineConfig) -> None:
    """What NxD's Qwen2-VL application does not run: it switches fused speculation off itself, and its
    forward drops ``adapter_ids``; quantizing its checkpoint is not wired here."""
    for flag, on in (
        ("--speculative-config", bool(config.speculative_config)),
        ("--enable-lora", config.enable_lora),
        ("--quantization", config.quantization is not None),
    ):
        if on:
            raise ConfigError(
                f"{flag} is not supported with Qwen2-VL on the nxd backend (NxD's Qwen2-VL application runs "
                "without it); use --backend torch or drop the flag."
            )


def vision_neuron_config(
    text_kwargs: dict[str, Any], vision_overrides: dict[str, Any], tokens_per_image: int
) -> dict[str, Any]:
    """The vision encoder's NeuronConfig kwargs, as NxDI's generate_qwen2_vl.py example builds them: one
    image batch, the text model's tp degree and dtype, ``buckets`` counting images per prompt (as many
    as the text bucket holds, NxDI's own assertion), ``fused_qkv`` (NxDI asserts it)."""
    kwargs: dict[str, Any] = {
        "batch_size": 1,
        "seq_len": text_kwargs["seq_len"],
        "tp_degree": text_kwargs["tp_degree"],
        "torch_dtype": text_kwargs["torch_dtype"],
        "enable_bucketing": True,
        "fused_qkv": True,
        "default_image_width": QWEN2_VL_DEFAULT_IMAGE_SIZE[0],
        "default_image_height": QWEN2_VL_DEFAULT_IMAGE_SIZE[1],
    }
    kwargs.update(vision_overrides)
    if "buckets" not in vision_overrides:
        most = max(1, int(text_kwargs["seq_len"]) // max(1, tokens_per_image))
        kwargs["buckets"] = sorted({min(n, most) for n in (1, 2, 4, 8)})
    return kwargs


def qwen2_vl_image_grid(width: int, height: int, patch_size: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of the image size NxD compiled Qwen2-VL's encoder for (NxDI resizes the
    default size with transformers' ``smart_resize``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    resized_height, resized_width = smart_resize(height=height, width=width)
    return 1, resized_height // patch_size, resized_width // patch_size


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
    return artifacts_root() / f"{model_path.name}-{key}", False


def artifacts_root() -> Path:
    """$NXDSERVE_NEURON_ARTIFACTS, else nxdserve's cache folder's neuron-artifacts."""
    root_env = os.environ.get(ARTIFACTS_ROOT_ENV)
    if root_env:
        return Path(root_env).expanduser()
    from nxdserve.model_files import cache_dir

    return cache_dir() / "neuron-artifacts"
