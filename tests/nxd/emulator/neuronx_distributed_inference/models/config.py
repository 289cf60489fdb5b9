"""NeuronConfig, OnDeviceSamplingConfig, InferenceConfig and friends, as NxDI 0.9 defines them.

Only the serving-relevant fields are modelled; every other keyword is kept as an attribute with a
warning, as NxDI does for unknown keywords (it logs and carries on).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)

CONFIG_FILE = "neuron_config.json"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def to_torch_dtype(dtype_str: str) -> torch.dtype:
    assert dtype_str in _DTYPES, f"Unsupported dtype: {dtype_str}"
    return _DTYPES[dtype_str]


def to_dict(obj: Any) -> Any:
    if type(obj) is dict:
        return {k: to_dict(v) for k, v in obj.items()}
    if type(obj) is list:
        return [to_dict(v) for v in obj]
    if inspect.isclass(obj):
        return {"__module__": obj.__module__, "__name__": obj.__name__}
    if hasattr(obj, "__dict__"):
        return {k: to_dict(v) for k, v in obj.__dict__.items()}
    if type(obj) is torch.dtype:
        return str(obj).split(".")[1]
    return obj


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.do_sample = kwargs.pop("do_sample", False)
        self.top_k = kwargs.pop("top_k", 1)
        self.top_p = kwargs.pop("top_p", 1.0)
        self.temperature = kwargs.pop("temperature", 1.0)
        self.dynamic = kwargs.pop("dynamic", False)
        self.deterministic = kwargs.pop("deterministic", False)
        self.global_topk = kwargs.pop("global_topk", 256)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", True)
        self.top_k_kernel_enabled = kwargs.pop("top_k_kernel_enabled", True)  # False only on trn1
        self.sampling_dp_degree = kwargs.pop("sampling_dp_degree", 1)


class ChunkedPrefillConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.max_num_seqs = kwargs.pop("max_num_seqs", 0)
        self.tkg_model_enabled = kwargs.pop("tkg_model_enabled", True)
        self.kernel_q_tile_size = kwargs.pop("kernel_q_tile_size", 128)
        self.kernel_kv_tile_size = kwargs.pop("kernel_kv_tile_size", 1024)


class KVQuantizationConfig:
    """neuronx_distributed.quantization.quantization_config.KVQuantizationConfig: the KV cache's dtype and how
    values get there (``direct_cast``: a plain cast; otherwise per-layer scale buffers, initialised to 1.0)."""

    def __init__(self, **kwargs: Any) -> None:
        self.quant_dtype = kwargs.pop("quant_dtype", torch.float8_e4m3fn)
        if isinstance(self.quant_dtype, str):  # as neuron_config.json stores it
            self.quant_dtype = getattr(torch, self.quant_dtype)
        self.k_quant_method = kwargs.pop("k_quant_method", "per_tensor_symmetric")
        self.v_quant_method = kwargs.pop("v_quant_method", "per_tensor_symmetric")
        self.direct_cast = kwargs.pop("direct_cast", True)
        assert not kwargs, f"KVQuantizationConfig: unexpected {sorted(kwargs)}"


class NeuronConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.batch_size = kwargs.pop("batch_size", 1)
        self.padding_side = kwargs.pop("padding_side", "right")
        self.allow_input_truncation = kwargs.pop("allow_input_truncation", False)
        self.seq_len = kwargs.pop("seq_len", 128)
        self.n_active_tokens = kwargs.pop("n_active_tokens", self.seq_len)
        self.n_positions = kwargs.pop("n_positions", self.seq_len)
        self.on_cpu = kwargs.pop("on_cpu", False)
        self.output_logits = kwargs.pop("output_logits", False)
        if "torch_dtype" in kwargs:
            self.torch_dtype = kwargs.pop("torch_dtype")
            if isinstance(self.torch_dtype, str):
                self.torch_dtype = to_torch_dtype(self.torch_dtype)
            self.overrides_torch_dtype = kwargs.pop("overrides_torch_dtype", True)
        else:
            self.torch_dtype = torch.bfloat16
            self.overrides_torch_dtype = False
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)
        self.max_new_tokens = kwargs.pop("max_new_tokens", self.seq_len - self.max_context_length) or None
        self.max_length = kwargs.pop("max_length", self.seq_len)
        assert self.max_context_length <= self.max_length, "max_context_length cannot be more than max_length"

        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        self.kv_cache_batch_size = kwargs.pop("kv_cache_batch_size", self.batch_size)
        self.kv_cache_padding_size = kwargs.pop("kv_cache_padding_size", 0)

        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", None)
        if type(self.on_device_sampling_config) is dict:
            self.on_device_sampling_config = OnDeviceSamplingConfig(**self.on_device_sampling_config)
        self.async_mode = kwargs.pop("async_mode", False)

        self.enable_bucketing = kwargs.pop("enable_bucketing", False)
        self.buckets = kwargs.pop("buckets", [self.seq_len])
        self.context_encoding_buckets = kwargs.pop("context_encoding_buckets", None)
        self.prefix_buckets = kwargs.pop("prefix_buckets", None)
        self.token_generation_buckets = kwargs.pop("token_generation_buckets", None)
        if self.context_encoding_buckets is not None:
            self.context_encoding_buckets.sort()
            assert self.context_encoding_buckets[-1] <= self.max_context_length, (
                f"Context bucket {self.context_encoding_buckets[-1]} should be <= {self.max_context_length}"
            )
        if self.token_generation_buckets is not None:
            self.token_generation_buckets.sort()
            assert self.token_generation_buckets[-1] <= self.max_length, (
                f"Token generation bucket {self.token_generation_buckets[-1]} should be <= {self.max_length}"
            )
        self.token_generation_batches = kwargs.pop("token_generation_batches", None)

        self.speculation_length = kwargs.pop("speculation_length", 0)
        self.spec_batch_size = kwargs.pop("spec_batch_size", self.batch_size)
        self.enable_fused_speculation = kwargs.pop("enable_fused_speculation", False)
        self.enable_eagle_speculation = kwargs.pop("enable_eagle_speculation", False)
        self.is_eagle3 = kwargs.pop("is_eagle3", False)
        self.is_eagle_draft = kwargs.pop("is_eagle_draft", False)
        if self.enable_eagle_speculation:
            self.enable_fused_speculation = True
        self.token_tree_config = kwargs.pop("token_tree_config", None)
        self.enable_token_tree = self.token_tree_config is not None
        self.is_medusa = kwargs.pop("is_medusa", False)
        self.medusa_speculation_length = kwargs.pop("medusa_speculation_length", 0)

        self.is_block_kv_layout = kwargs.pop("is_block_kv_layout", False)
        self.pa_num_blocks = kwargs.pop("pa_num_blocks", self.batch_size)
        self.pa_block_size = kwargs.pop("pa_block_size", self.seq_len)
        self.is_prefix_caching = kwargs.pop("is_prefix_caching", False)
        self.chunked_prefill_config = kwargs.pop("chunked_prefill_config", None)
        if type(self.chunked_prefill_config) is dict:
            self.chunked_prefill_config = ChunkedPrefillConfig(**self.chunked_prefill_config)
        self.is_chunked_prefill = self.chunked_prefill_config is not None
        if self.is_chunked_prefill:
            assert self.is_block_kv_layout, "is_block_kv_layout has to be true for chunked prefill"

        self.apply_seq_ids_mask = kwargs.pop("apply_seq_ids_mask", False)
        self.lora_config = kwargs.pop("lora_config", None)
        if type(self.lora_config) is dict:
            from neuronx_distributed_inference.modules.lora_serving import LoraServingConfig

            self.lora_config = LoraServingConfig(**self.lora_config)
        self.skip_warmup = kwargs.pop("skip_warmup", False)
        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        # Weight quantization (NxDI models/config.py): per-tensor / per-channel symmetric int8 or f8e4m3, the
        # checkpoint written by the application's save_quantized_state_dict and read at load.
        self.quantized = kwargs.pop("quantized", False)
        self.quantized_checkpoints_path = kwargs.pop("quantized_checkpoints_path", None)
        if self.quantized is True:
            assert self.quantized_checkpoints_path is not None, "quantized_checkpoints_path is required"
        self.quantization_type = kwargs.pop("quantization_type", "per_tensor_symmetric")
        self.quantization_dtype = kwargs.pop("quantization_dtype", "int8")
        self.quantization_block_size = kwargs.pop("quantization_block_size", None)
        self.quantization_block_axis = kwargs.pop("quantization_block_axis", None)
        self.quantization_scale_dtype = kwargs.pop("quantization_scale_dtype", "f32")
        self.modules_to_not_convert = kwargs.pop("modules_to_not_convert", None)
        self.draft_model_modules_to_not_convert = kwargs.pop("draft_model_modules_to_not_convert", None)
        if self.quantized and (
            self.quantization_type not in ("per_tensor_symmetric", "per_channel_symmetric")
            or self.quantization_dtype not in ("int8", "f8e4m3")
        ):
            raise NotImplementedError(
                f"emulator: {self.quantization_type} {self.quantization_dtype} quantization is not emulated"
            )
        self.kv_cache_quant = kwargs.pop("kv_cache_quant", False)
        self.kv_quant_config = kwargs.pop("kv_quant_config", None)
        if type(self.kv_quant_config) is dict:
            self.kv_quant_config = KVQuantizationConfig(**self.kv_quant_config)

        self.fused_qkv = kwargs.pop("fused_qkv", False)  # asserted on by Qwen2-VL's vision config
        self.tp_degree = kwargs.pop("tp_degree", 1)
        self.cp_degree = kwargs.pop("cp_degree", 1)
        self.pp_degree = kwargs.pop("pp_degree", 1)
        self.ep_degree = kwargs.pop("ep_degree", 1)
        self.world_size = kwargs.pop("world_size", self.tp_degree * self.pp_degree * self.ep_degree)
        self.start_rank_id = kwargs.pop("start_rank_id", 0)
        self.local_ranks_size = kwargs.pop("local_ranks_size", self.world_size)

        for key, value in kwargs.items():  # NxDI warns about unknown keywords and keeps going
            logger.warning("NeuronConfig init: Unexpected keyword arguments: %s", {key: value})
            setattr(self, key, value)


class InferenceConfig:
    attribute_map: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        neuron_config: NeuronConfig,
        fused_spec_config: Any = None,
        load_config: Any = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    # Aliases (HF's attribute_map, copied in by load_pretrained_config) resolve on get and set.
    def __setattr__(self, key: str, value: Any) -> None:
        if key != "attribute_map":
            key = self._aliases().get(key, key)
        super().__setattr__(key, value)

    def __getattr__(self, key: str) -> Any:  # only called when normal lookup fails
        target = self._aliases().get(key)
        if target is None or target == key:
            raise AttributeError(key)
        return getattr(self, target)

    def _aliases(self) -> dict[str, str]:
        return self.__dict__.get("attribute_map", type(self).attribute_map)

    def add_derived_config(self) -> None:
        self.num_cores_per_group = 1

    def load_config(self) -> None:
        pass

    def get_required_attributes(self) -> list[str]:
        return []

    def validate_config(self) -> None:
        missing = [x for x in self.get_required_attributes() if not hasattr(self, x)]
        assert not missing, f"Config must define {missing}"

    def save(self, model_path: str | os.PathLike[str]) -> None:
        os.makedirs(model_path, exist_ok=True)
        with open(os.path.join(model_path, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(self.to_json_string() + "\n")

    def to_json_string(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    def get_text_config(self) -> InferenceConfig:
        return self

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], **kwargs: Any) -> InferenceConfig:
        with open(os.path.join(model_path, CONFIG_FILE), encoding="utf-8") as f:
            merged = json.loads(f.read())
        merged.update(kwargs)
        if isinstance(merged.get("neuron_config"), dict):
            merged["neuron_config"] = cls.get_neuron_config_cls()(**merged["neuron_config"])
        spec = merged.get("fused_spec_config")
        if isinstance(spec, dict):
            worker = spec["worker_cls"]
            worker_cls = getattr(importlib.import_module(worker["__module__"]), worker["__name__"])
            draft = dict(spec["draft_config"])
            draft["neuron_config"] = cls.get_neuron_config_cls()(**draft["neuron_config"])
            merged["fused_spec_config"] = FusedSpecNeuronConfig(
                worker_cls, draft_config=cls(**draft), draft_model_path=spec.get("draft_model_path")
            )
        return cls(**merged)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


class FusedSpecNeuronConfig:
    def __init__(
        self,
        worker_cls: Any,
        draft_config: InferenceConfig | None = None,
        draft_model_path: str | None = None,
        draft_model_cls: Any = None,
    ) -> None:
        self.worker_cls = worker_cls
        self.draft_model_cls = draft_model_cls
        self.draft_config = draft_config
        self.draft_model_path = draft_model_path
