"""NeuronBaseForCausalLM: the application forward, and the "traced" submodels it routes to.

Routing (``_get_model_outputs``): ``position_ids.min() == 0`` runs context encoding, else the fused
speculation model when enabled, else token generation. The submodels run nxdserve's torch reference
model over one KV cache of ``kv_cache_batch_size`` lines x ``max_length`` positions, with NxDI's
row semantics:

- context encoding (continuous batching): one row, written into line ``seq_ids[0]`` for the whole
  bucket (pad tokens included); the output is taken at the first ``argmax(position_ids)``;
- token generation: a compiled-size batch where row i reads and writes line i, whatever seq_ids say
  (seq_ids only matter through ``_forward_with_pad``); with ``apply_seq_ids_mask`` rows whose seq_id
  is -1 write nowhere;
- fused speculation: a greedy draft proposes k-1 tokens (k runs, the last only filling draft KV),
  the target verifies k positions and the contiguous matches plus one target token are returned,
  padded with -1, with ``next_pos_ids = position_ids + n_accepted``.

LoRA (``lora_config``): the static case. Every adapter in ``lora_ckpt_paths`` is loaded at load time (PEFT
folders, read by nxdserve's own loader) into the target's LoRA buffers; ``adapter_ids`` (B,) index them per
row (0 = the zero adapter with ``enable_base_model_only``). Rows carry their adapter to the KV line they
run on, so the wrapper's padding and reordering need no extra plumbing. Dynamic multi-LoRA is not emulated.

Quantization (``quantized``): the linears come from ``quantized_checkpoints_path`` (modules/quantization.py).

Prefix caching, block KV, chunked prefill, medusa, dynamic LoRA and async mode are outside the emulator
and raise NotImplementedError, so a test never silently exercises a path that is not modelled.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from neuronx_distributed_inference.models.application_base import NeuronApplicationBase
from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_wrapper import (
    CONTEXT_ENCODING_MODEL_TAG,
    FUSED_SPECULATION_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
    ModelWrapper,
    Outputs,
)
from neuronx_distributed_inference.modules.autobucketing import (
    generate_buckets_for_cte,
    generate_buckets_for_fused_spec,
    generate_buckets_for_tkg,
)
from neuronx_distributed_inference.modules.generation.sampling import (
    Sampler,
    infer_sampling_params,
    prepare_sampling_params,
    validate_sampling_params,
)
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.runner import SlotModelRunner
from nxdserve.lora.adapter import load_peft_adapter
from nxdserve.lora.stack import LoraStack

logger = logging.getLogger(__name__)

ACCEPTANCE_PADDING_TOKEN = -1


class NeuronBaseForCausalLM(NeuronApplicationBase):
    _model_cls: ClassVar[Any] = None

    def __init__(self, model_path: str, config: InferenceConfig | None = None,
                 neuron_config: NeuronConfig | None = None) -> None:
        super().__init__(model_path, config, neuron_config)
        nc = self.neuron_config
        if nc.is_chunked_prefill:
            raise NotImplementedError("Chunked Prefill is not available in NxDI for now")
        for flag in ("is_prefix_caching", "is_block_kv_layout", "is_medusa", "async_mode", "enable_token_tree"):
            if getattr(nc, flag):
                raise NotImplementedError(f"emulator: {flag} is not emulated")
        if nc.token_generation_batches is not None:
            raise NotImplementedError("emulator: batch bucketing is not emulated")
        if nc.lora_config is not None and nc.lora_config.dynamic_multi_lora:
            raise NotImplementedError("emulator: dynamic multi-LoRA is not emulated")
        if nc.speculation_length > 0 and not nc.enable_fused_speculation:
            raise NotImplementedError("emulator: the unfused speculation model is not emulated")
        self.default_sampling_params = prepare_sampling_params(batch_size=nc.batch_size)
        self.sampler = Sampler(nc) if self.on_device_sampling else None
        spec_len = nc.speculation_length if nc.enable_fused_speculation else 0
        common = {
            "pad_token_id": int(getattr(self.config, "pad_token_id", None) or 0),
            "max_context_length": nc.max_context_length,
            "max_length": nc.max_length,
            "allow_input_truncation": nc.allow_input_truncation,
            "apply_seq_ids_mask": nc.apply_seq_ids_mask,
        }
        self.context_encoding_model = ModelWrapper(
            CONTEXT_ENCODING_MODEL_TAG, self._traced_cte, batch_size=nc.ctx_batch_size,
            buckets=generate_buckets_for_cte(self.config), **common,
        )
        if nc.enable_fused_speculation:
            self.generation_model = ModelWrapper(
                FUSED_SPECULATION_MODEL_TAG, self._traced_fused, batch_size=nc.tkg_batch_size,
                buckets=generate_buckets_for_fused_spec(self.config), speculation_length=spec_len, **common,
            )
        else:
            self.generation_model = ModelWrapper(
                TOKEN_GENERATION_MODEL_TAG, self._traced_tkg, batch_size=nc.tkg_batch_size,
                buckets=generate_buckets_for_tkg(self.config), **common,
            )
        self.target: SlotModelRunner | None = None
        self.draft: SlotModelRunner | None = None
        # Test probes: every submodel call, and EAGLE's hidden-state buffer bookkeeping.
        self.calls: list[dict[str, Any]] = []
        self.eagle_next_pos: dict[int, int] = {}
        self.eagle_buffer_misses = 0
        self.lora: LoraStack | None = None
        self.line_adapter = np.full(nc.kv_cache_batch_size + 1, -1, dtype=np.int64)  # KV line -> LoRA slot

    # -- load ----------------------------------------------------------------------------------------
    def load_weights(self, compiled_model_path: str) -> None:
        nc = self.neuron_config
        lines = nc.kv_cache_batch_size + (1 if nc.apply_seq_ids_mask else 0)  # last line: masked writes
        self.target = _runner(self._weights_path(), nc, lines)
        if nc.quantized:  # the linears from the quantized checkpoint (NxD loads it instead of the HF weights)
            from neuronx_distributed_inference.modules.quantization import apply_quantized_checkpoint

            apply_quantized_checkpoint(self.target.model, nc)
        if nc.lora_config is not None:
            self.lora = _lora_stack(nc.lora_config, self.target)
        if nc.enable_fused_speculation:
            spec = self.fused_spec_config
            assert spec is not None and spec.draft_model_path, "fused speculation needs a draft model"
            self.draft = _runner(spec.draft_model_path, spec.draft_config.neuron_config, lines, nc.max_length)

    def _weights_path(self) -> str:
        # Shard-on-load reads the HF checkpoint: the constructor's path, or the config's source.
        if Path(self.model_path, "config.json").is_file():
            return self.model_path
        return str(self.config._name_or_path)

    def _run_warmup(self) -> None:
        # Every bucket once, with NxDI-style example inputs: this writes into KV lines, as on device.
        nc = self.neuron_config
        for bucket in self.context_encoding_model.buckets:
            b = nc.ctx_batch_size
            pos = torch.arange(bucket, dtype=torch.int32).expand(b, bucket)
            self._traced_cte(torch.zeros((b, bucket), dtype=torch.int32), torch.ones_like(pos), pos,
                             torch.arange(b, dtype=torch.int32), self.default_sampling_params[:b])
        for bucket in self.generation_model.buckets:
            b = nc.tkg_batch_size
            k = self.generation_model.speculation_length
            pos = torch.full((b, 1), bucket - max(k, 1), dtype=torch.int32)
            fn = self._traced_fused if nc.enable_fused_speculation else self._traced_tkg
            fn(torch.zeros((b, 1), dtype=torch.int32), torch.ones((b, bucket), dtype=torch.int32), pos,
               torch.arange(b, dtype=torch.int32), self.default_sampling_params[:b])
        self.eagle_next_pos.clear()

    # -- the application forward ---------------------------------------------------------------------
    def forward(  # NxDI's signature, unused arguments included
        self,
        input_ids: torch.Tensor | None = None,
        seq_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: Any = None,
        sampling_params: torch.Tensor | None = None,
        prev_hidden: Any = None,
        labels: Any = None,
        use_cache: Any = None,
        output_attentions: Any = None,
        output_hidden_states: Any = None,
        adapter_ids: Any = None,
        medusa_args: Any = None,
        return_dict: Any = None,
        llava_args: Any = None,
        input_capture_hook: Any = None,
        tensor_capture_hook: Any = None,
        slot_mapping: Any = None,
        block_table: Any = None,
        full_context_lens: Any = None,
        computed_context_lens: Any = None,
        tf_args: Any = None,
    ) -> CausalLMOutputWithPast:
        if not self.is_loaded_to_neuron:
            raise RuntimeError("Forward called before load. Run load() or load_state_dict() making calling forward")
        assert input_ids is not None and position_ids is not None
        if attention_mask is None:
            attention_mask = self._infer_attention_mask(position_ids)
        if seq_ids is None:
            seq_ids = torch.arange(input_ids.shape[0])
        if sampling_params is None:
            sampling_params = self.default_sampling_params
        if self.on_device_sampling:
            validate_sampling_params(sampling_params, self.neuron_config.on_device_sampling_config)
        sampling_params = infer_sampling_params(sampling_params)

        if self.lora is not None:
            self._route_adapters(seq_ids, adapter_ids)
        elif adapter_ids is not None:
            raise ValueError("adapter_ids given to a model compiled without lora_config")
        args = (input_ids, attention_mask, position_ids, seq_ids, sampling_params)
        if self._is_prefill(position_ids):
            tag, outputs = CONTEXT_ENCODING_MODEL_TAG, self.context_encoding_model(*args)
        else:
            tag, outputs = self.generation_model.tag, self.generation_model(*args)
        self.calls.append({"tag": tag, "batch": int(input_ids.shape[0]), "seq_len": int(input_ids.shape[1]),
                           "seq_ids": seq_ids.tolist(), "positions": position_ids[:, -1].tolist()})
        if self.neuron_config.enable_eagle_speculation:
            self._eagle_bookkeeping(tag, seq_ids, position_ids, outputs)
        return self._construct_output(outputs)

    __call__ = forward

    def _route_adapters(self, seq_ids: torch.Tensor, adapter_ids: Any) -> None:
        cfg = self.neuron_config.lora_config
        ids = torch.zeros(seq_ids.shape[0], dtype=torch.long) if adapter_ids is None else adapter_ids.long()
        limit = cfg.max_loras + int(cfg.enable_base_model_only)
        if ids.shape != seq_ids.shape or int(ids.min()) < 0 or int(ids.max()) >= limit:
            raise ValueError(f"adapter_ids {ids.tolist()} outside 0..{limit - 1} for seq_ids {seq_ids.tolist()}")
        slots = ids.numpy() - int(cfg.enable_base_model_only)  # -1: the zero adapter
        lines = seq_ids.numpy()
        valid = lines >= 0
        self.line_adapter[lines[valid]] = slots[valid]

    def _lora_step(self, token_lines: np.ndarray) -> Any:
        return None if self.lora is None else self.lora.step(self.line_adapter[token_lines])

    @staticmethod
    def _is_prefill(position_ids: torch.Tensor) -> bool:
        return int(position_ids.min()) == 0

    @staticmethod
    def _infer_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len = position_ids.shape
        if seq_len != 1:
            compare = position_ids
        else:
            seq_len = int(torch.max(position_ids))
            compare = position_ids.expand(batch_size, seq_len) - 1
        mask = torch.arange(seq_len).view(1, -1).expand(batch_size, seq_len)
        return (compare >= mask).to(dtype=position_ids.dtype)

    def _construct_output(self, outputs: Outputs) -> CausalLMOutputWithPast:
        nc = self.neuron_config
        if nc.enable_fused_speculation:
            out = CausalLMOutputWithPast(logits=None, hidden_states=outputs)
            out.fused_outputs = outputs
            return out
        if self.on_device_sampling and nc.output_logits:
            assert isinstance(outputs, list)
            out = CausalLMOutputWithPast(logits=outputs[1], hidden_states=[])
            out.tokens = outputs[0]
            return out
        out = CausalLMOutputWithPast(logits=None if self.on_device_sampling else outputs, hidden_states=outputs)
        out.tokens = outputs
        return out

    def _eagle_bookkeeping(self, tag: str, seq_ids: torch.Tensor, position_ids: torch.Tensor,
                           outputs: Outputs) -> None:
        # EAGLE keeps target hidden states on device in a buffer indexed by (seq_id, position); a draft
        # that finds no state for its seq_id at the expected position works from garbage.
        assert isinstance(outputs, list)
        next_pos = outputs[3][:, 0].tolist()
        for row, seq in enumerate(seq_ids.tolist()):
            if tag != CONTEXT_ENCODING_MODEL_TAG and self.eagle_next_pos.get(seq) != int(position_ids[row, -1]):
                self.eagle_buffer_misses += 1
            self.eagle_next_pos[seq] = int(next_pos[row])

    # -- "traced" submodels ----------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, sampling_params: torch.Tensor) -> torch.Tensor:
        assert self.sampler is not None
        return self.sampler(logits, sampling_params).to(torch.int32)

    def _cte_forward(self, runner: SlotModelRunner, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     seq_ids: torch.Tensor) -> torch.Tensor:
        """Run each row over its whole bucket into its line; (B, V) logits at argmax(position_ids)."""
        batch, bucket = input_ids.shape
        if self.neuron_config.is_continuous_batching:
            assert batch == 1, "continuous batching context encoding runs one sequence per call"
            lines = seq_ids.tolist()
        else:
            lines = list(range(batch))
        gathered = []
        for row, line in enumerate(lines):
            lora = self._lora_step(np.full(bucket, line)) if runner is self.target else None
            hidden = runner.run(input_ids[row].long(), np.array([line]), np.array([0]), np.array([bucket]), lora=lora)
            index = torch.max(position_ids[row], dim=0).indices  # the first maximum, as the device gather
            gathered.append(hidden[index])
        return runner.logits(torch.stack(gathered))

    def _traced_cte(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    seq_ids: torch.Tensor, sampling_params: torch.Tensor) -> Outputs:
        assert self.target is not None
        logits = self._cte_forward(self.target, input_ids, position_ids, seq_ids)
        if self.neuron_config.enable_fused_speculation:
            assert self.draft is not None
            self._cte_forward(self.draft, input_ids, position_ids, seq_ids)  # fills the draft's KV
            token = self._sample(logits, sampling_params)
            return self._fused_cte_outputs(token, attention_mask)
        return self._outputs(logits, sampling_params)

    def _outputs(self, logits: torch.Tensor, sampling_params: torch.Tensor) -> Outputs:
        if not self.on_device_sampling:
            return logits.unsqueeze(1)  # (B, 1, V) float32
        tokens = self._sample(logits, sampling_params)
        if self.neuron_config.output_logits:
            return [tokens, logits.unsqueeze(1)]
        return tokens

    def _active_rows(self, seq_ids: torch.Tensor) -> np.ndarray:
        """Rows that read/write KV: all of them, unless seq-id masking sends -1 rows to a garbage line."""
        if self.neuron_config.apply_seq_ids_mask:
            return np.flatnonzero(seq_ids.numpy() >= 0)
        return np.arange(seq_ids.shape[0])

    def _traced_tkg(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    seq_ids: torch.Tensor, sampling_params: torch.Tensor) -> Outputs:
        assert self.target is not None
        rows = self._active_rows(seq_ids)
        positions = position_ids[:, 0].long().numpy()
        logits = torch.zeros(input_ids.shape[0], self.target.model.vocab_size)
        hidden = self.target.run(input_ids[rows, 0].long(), rows, positions[rows], np.ones(rows.size, dtype=np.int64),
                                 lora=self._lora_step(rows))
        logits[torch.from_numpy(rows)] = self.target.logits(hidden)
        return self._outputs(logits, sampling_params)

    def _traced_fused(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      seq_ids: torch.Tensor, sampling_params: torch.Tensor) -> Outputs:
        assert self.target is not None and self.draft is not None
        k = self.neuron_config.speculation_length
        batch = input_ids.shape[0]
        rows = self._active_rows(seq_ids)
        pos = position_ids[:, 0].long().numpy()
        ones = np.ones(rows.size, dtype=np.int64)
        candidates = [input_ids[:, 0].long()]
        for i in range(k):  # k greedy draft runs; the last only fills draft KV for the last draft
            hidden = self.draft.run(candidates[-1][rows], rows, pos[rows] + i, ones)
            drafted = torch.zeros(batch, dtype=torch.long)
            drafted[torch.from_numpy(rows)] = self.draft.logits(hidden).argmax(dim=-1)
            candidates.append(drafted)
        verify = torch.stack(candidates[:k], dim=1)  # (B, k): input + k-1 drafts
        hidden = self.target.run(verify[rows].reshape(-1), rows, pos[rows], ones * k,
                                 lora=self._lora_step(np.repeat(rows, k)))
        target_logits = torch.zeros(batch, k, self.target.model.vocab_size)
        target_logits[torch.from_numpy(rows)] = self.target.logits(hidden).view(rows.size, k, -1)
        params = sampling_params.repeat_interleave(k, dim=0)
        target_tokens = self._sample(target_logits.view(batch * k, -1), params).view(batch, k)
        drafts = torch.stack(candidates[1:k], dim=1).to(torch.int32)  # (B, k-1)
        n_matches = ((drafts != target_tokens[:, :-1]).cumsum(dim=-1) < 1).sum(dim=-1, keepdim=True) + 1
        keep = torch.arange(k).expand(batch, k) < n_matches
        accepted = torch.where(keep, target_tokens, torch.full_like(target_tokens, ACCEPTANCE_PADDING_TOKEN))
        next_pos = (position_ids + n_matches).to(torch.int32)
        return [accepted.to(torch.int32), *_next_inputs(accepted, next_pos, attention_mask.shape[1])]

    def _fused_cte_outputs(self, token: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        k = self.neuron_config.speculation_length
        batch = token.shape[0]
        padded = torch.cat([token.view(batch, 1), torch.full((batch, k - 1), ACCEPTANCE_PADDING_TOKEN,
                                                             dtype=torch.int32)], dim=1)
        next_pos = attention_mask.sum(dim=1, keepdim=True).to(torch.int32)
        return [padded, *_next_inputs(padded, next_pos, self.neuron_config.seq_len)]


def _next_inputs(accepted: torch.Tensor, next_pos: torch.Tensor, mask_len: int) -> list[torch.Tensor]:
    """next_input_ids (B, 1), next_attention_mask (B, mask_len), next_pos_ids (B, 1)."""
    batch = accepted.shape[0]
    n = (accepted != ACCEPTANCE_PADDING_TOKEN).sum(dim=1)
    next_input_ids = accepted[torch.arange(batch), n - 1].view(batch, 1)
    mask = (next_pos.expand(batch, mask_len) - 1 >= torch.arange(mask_len).view(1, -1)).to(torch.int32)
    return [next_input_ids, mask, next_pos]


def _lora_stack(cfg: Any, runner: SlotModelRunner) -> LoraStack:
    """Every compile-time adapter into its buffer slot, in ``lora_ckpt_paths`` order."""
    paths = cfg.ckpt_paths()
    if len(paths) > cfg.max_loras:
        raise ValueError(f"{len(paths)} adapters in lora_ckpt_paths but max_loras={cfg.max_loras}")
    model = runner.model
    stack = LoraStack(model.spec, cfg.max_loras, cfg.max_lora_rank, model.dtype, model.device)
    for i, (name, path) in enumerate(paths):
        adapter = load_peft_adapter(path, model.spec, cfg.max_lora_rank, name, i + 1)
        assert stack.slot_for(adapter, set()) == i
    return stack


def _runner(path: str, nc: NeuronConfig, lines: int, max_len: int | None = None) -> SlotModelRunner:
    max_len = max_len or nc.max_length
    model = LlamaFamilyModel.from_pretrained(path, nc.torch_dtype, torch.device("cpu"), max_len=max_len)
    return SlotModelRunner(model, lines, max_len, kv_cache_dtype=_kv_cache_dtype(nc))


# KVCacheManager's cache dtype (kv_quant_config.quant_dtype) as the reference runner's --kv-cache-dtype.
_KV_QUANT_DTYPES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def _kv_cache_dtype(nc: NeuronConfig) -> str:
    """NxD stores ``x.to(quant_dtype)`` with ``direct_cast``, and ``x / scale`` with per-layer scale buffers
    that start at 1.0 otherwise: both are the runner's fp8 cache at scale 1.0. Scales loaded from a checkpoint,
    and non-fp8 quant dtypes, are not modelled."""
    kv = nc.kv_quant_config
    if kv is None:
        return "auto"
    if kv.quant_dtype not in _KV_QUANT_DTYPES:
        raise NotImplementedError(f"the emulator stores KV in fp8 only, not {kv.quant_dtype}")
    return _KV_QUANT_DTYPES[kv.quant_dtype]
