"""The torch reference backend: our Llama-family model over a slot KV cache, sampling on device.

One ``execute`` = one forward over every scheduled row (decodes, verifications and prefill chunks
mixed), logits only where they are needed, then the shared ``Sampler``:
- rows that sample: the last ``1 + num_drafts`` positions (a plain decode: its one position);
- rows whose request asked for prompt logprobs: every chunk position that predicts a prompt token;
- draft alternatives (``StepPlan.draft_alternatives``): their one position each, run after the rows.
Inputs come from the persistent batch with vectorised numpy; there is no per-row Python work on the
decode path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.base import Backend
from nxdserve.engine.backends.weight_format import WeightFormat, default_weight_format
from nxdserve.engine.models import SlotModelRunner, cpu_setup, quant, resolve_device, resolve_dtype
from nxdserve.engine.models.attention import DEFAULT_BATCHED_QUERY_LIMIT, DraftAlternatives
from nxdserve.engine.models.compressed_tensors import resolve_quantization
from nxdserve.engine.models.cpu_threads import ThreadBinding, ThreadGovernor
from nxdserve.engine.models.quant_steps import choose_small_step_path
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.sampling.sampler import accept_greedy
from nxdserve.engine.step import BackendCapabilities, LogprobsBlock, StepPlan, StepResult
from nxdserve.engine.structured.mask import TokenMask
from nxdserve.errors import ConfigError
from nxdserve.lora.stack import LoraStack
from nxdserve.model_files import eos_token_ids

if TYPE_CHECKING:
    from nxdserve.engine.models.mllama import MllamaModel, SlotCrossStates
    from nxdserve.engine.models.quant import LinearMaker
    from nxdserve.engine.models.qwen2_vl import Qwen2VLModel, SlotImages

logger = logging.getLogger(__name__)

# Prompt-logprob positions per lm_head call: bounds the (positions, vocab) float32 logits buffer.
PROMPT_LOGPROBS_BLOCK = 256


class SamplerLike(Protocol):
    """What the backend needs from ``nxdserve.engine.sampling.sampler.Sampler``."""

    vocab_size: int

    def plain_greedy(self, slots: np.ndarray, batch: PersistentBatch) -> bool: ...

    def sample(
        self, logits: torch.Tensor, slots: np.ndarray, batch: PersistentBatch, token_mask: TokenMask | None = None
    ) -> Any: ...

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        slots: np.ndarray,
        batch: PersistentBatch,
        draft_probs: torch.Tensor | None,
        token_mask: TokenMask | None = None,
    ) -> Any: ...


class TorchBackend(Backend):
    name = "torch"
    reports_forward_start = True

    def __init__(self, model_path: Path, config: EngineConfig, sampler: SamplerLike | None = None) -> None:
        if config.max_model_len is None:
            raise ConfigError("TorchBackend needs a resolved EngineConfig (max_model_len is unset).")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = resolve_device(config.device)
        self.kernel_path = cpu_setup.apply(config.cpu) if self.device.type == "cpu" else "none"
        if self.device.type == "cpu":
            logger.info("CPU kernels: %s (--cpu-isa %s)", self.kernel_path, config.cpu.isa)
        # On CPU, each step runs on all intra-op threads or on one, whichever the machine's load favours
        # (see cpu_threads.py). CpuOptions.thread_governor=False: always all.
        threads = torch.get_num_threads()
        governed = self.device.type == "cpu" and config.cpu.thread_governor
        self.thread_governor = ThreadGovernor(threads if governed else 1)
        self._max_threads = threads
        self.thread_binding = ThreadBinding([] if self.device.type != "cpu" else None, config.cpu.bind_threads)
        self.dtype = resolve_dtype(config.dtype, self.device, config.cpu.isa)
        # A pre-quantized checkpoint names its own format (vLLM's auto-detection); a clashing flag fails here.
        config.quantization = resolve_quantization(config.quantization, model_path)
        started = time.perf_counter()
        # A vision-language model (Qwen2-VL, Mllama): its decoder runs in the slot runner, its encoder at admission.
        self.vlm = _vision_language_model(model_path, self.dtype, self.device, config.max_model_len)
        if config.enable_lora and type(self.vlm).__name__ == "MllamaModel":  # adapters know no cross layers
            raise ConfigError("--enable-lora is not supported with Mllama (cross-attention) models yet.")
        self.weight_format = default_weight_format(
            config, _gguf_file(config), self.device, self.dtype, self.kernel_path, self.vlm is not None
        )
        # Quantized (or bf16) as it loads where the format needs nothing but each weight: the dense model is
        # never whole in memory (LlamaFamilyModel.load_weights).
        bf16_at_load = self.weight_format.quantization is None and self._bf16_weights_apply(config)
        quantize_linear = None if self.vlm is not None else self._load_time_quantizer(config, model_path, bf16_at_load)
        if self.vlm is None:
            self.runner = SlotModelRunner.from_pretrained(
                model_path, config.max_num_seqs, config.max_model_len, self.dtype, self.device,
                kv_cache_dtype=config.kv_cache_dtype, calculate_kv_scales=config.calculate_kv_scales,
                quantize_linear=quantize_linear,
            )  # fmt: skip
        else:
            self.runner = SlotModelRunner(
                self.vlm.text, config.max_num_seqs, config.max_model_len,
                kv_cache_dtype=config.kv_cache_dtype, calculate_kv_scales=config.calculate_kv_scales,
            )  # fmt: skip
        self.image_encode_s = 0.0  # seconds spent in the vision encoder (benchmarks read it)
        self.model = self.runner.model
        config.quantization = self._quantize(config, model_path, self.weight_format, quantize_linear)
        bf16_weights = self._bf16_weights_apply(config)  # also where a default quantization fell back to dense
        if bf16_weights:
            from nxdserve.engine.models.quant import store_bf16

            self.model.quantize_linears(lambda _name, weight: store_bf16(weight))
            logger.info("weights: bf16, multiplied in fp32 (no native bf16 here; --no-cpu-bf16-weights for fp32)")
        logger.info(
            "torch backend: %s on %s in %s (weights: %s), %d slots x %d positions (KV cache %.0f MiB in %s), "
            "loaded in %.1f s",
            self.model.spec.model_type,
            self.device,
            str(self.dtype).removeprefix("torch."),
            config.quantization or ("bf16, multiplied in fp32" if bf16_weights else "dense"),
            config.max_num_seqs,
            config.max_model_len,
            self.runner.kv_cache.nbytes / 2**20,
            str(self.runner.kv_cache.data.dtype).removeprefix("torch."),
            time.perf_counter() - started,
        )
        if sampler is None:
            from nxdserve.engine.sampling.sampler import Sampler

            sampler = Sampler(self.model.vocab_size, self.device, seed=config.seed)
        self.sampler = sampler
        # Only a bf16 head (greedy_head) or a quantized one (its row kernel's argmax) on the CPU can give greedy
        # tokens without logits; elsewhere the per-step plain-greedy check would be work the sampler does again.
        self._greedy_from_head = self.device.type == "cpu" and (
            self.dtype == torch.bfloat16 or self.model.lm_head_quant is not None
        )
        # Set by proposers that need the target's final hidden states (EAGLE).
        self.keep_hidden_states = False
        self._capabilities = BackendCapabilities(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_prompt_len=config.max_model_len - 1,
            vocab_size=self.model.vocab_size,
            mixed_prefill_decode=True,
            chunked_prefill=True,
            supports_draft_verification=True,
            draft_alternatives=True,
            eos_token_ids=tuple(sorted(eos_token_ids(model_path))),
            image_inputs=self.vlm is not None,
        )
        # Multi-LoRA: the adapters' stacked buffers; each slot's adapter rides the persistent batch (lora_slot).
        self.lora_stack = (
            LoraStack(self.model.spec, config.max_loras, config.max_lora_rank, self.dtype, self.device)
            if config.enable_lora
            else None
        )
        self._warm_up()

    def _load_time_quantizer(self, config: EngineConfig, model_path: Path, bf16_weights: bool) -> LinearMaker | None:
        """What quantizes each decoder linear as the checkpoint loads: ``store_bf16`` for bf16 weights, the chosen
        method's ``linear_quantizer`` where it needs no calibration; None otherwise, and where the method cannot
        apply (``_quantize`` then meets the same error after the load, and reports it or falls back to dense)."""
        from nxdserve.engine.models import quant
        from nxdserve.engine.models.spec import ModelSpec
        from nxdserve.model_files import load_hf_config

        if bf16_weights:
            return lambda _name, weight: quant.store_bf16(weight)
        method = self.weight_format.quantization
        if method is None:
            return None
        spec = ModelSpec.from_hf_config(load_hf_config(model_path))
        try:
            return quant.linear_quantizer(method, spec, spec.num_layers, _gguf_file(config), model_path)
        except ConfigError:
            return None

    def _quantize(
        self, config: EngineConfig, model_path: Path, chosen: WeightFormat, make: LinearMaker | None = None
    ) -> str | None:
        """Put ``chosen``'s quantized linears in place of the loaded dense ones (those ``make`` did not quantize
        at load, the LM head among them); returns the format served. A default choice whose file turns out to hold
        linears in a type not served quantized stays dense."""
        if chosen.quantization is None:
            if config.dtype == "auto" and _gguf_file(config) is not None:
                logger.info("weights: dense %s (%s)", str(self.dtype).removeprefix("torch."), chosen.reason)
            return None
        from nxdserve.engine.models.quant import quantize_model

        try:
            quantize_model(
                self.model, chosen.quantization, _gguf_file(config), checkpoint=model_path,
                lora=config.enable_lora, make=make, tune_epochs=config.quantization_tune_epochs,
            )  # fmt: skip
        except ConfigError as exc:
            if not chosen.by_default:
                raise
            logger.info("weights: dense %s, not the file's blocks: %s", str(self.dtype).removeprefix("torch."), exc)
            return None
        if chosen.by_default:
            logger.info("weights: --quantization %s by default: %s", chosen.quantization, chosen.reason)
        else:
            logger.info("weights: --quantization %s", chosen.quantization)
        return chosen.quantization

    def _bf16_weights_apply(self, config: EngineConfig) -> bool:
        """``CpuOptions.bf16_weights``: a dense model whose ``--dtype auto`` resolved to fp32 on the CPU (no native
        bf16, or a kernel build forced below it), with the C kernels that multiply bf16 weights in fp32."""
        from nxdserve.engine.models import cpu_kernels

        return (
            config.cpu.bf16_weights
            and config.dtype == "auto"
            and config.quantization is None
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and self.vlm is None
            and cpu_kernels.available()
        )

    @property
    def capabilities(self) -> BackendCapabilities:
        return self._capabilities

    def lora_model_spec(self) -> ModelSpec:
        return self.model.spec

    def drop_lora(self, lora_int_id: int) -> None:
        if self.lora_stack is not None:
            self.lora_stack.evict(lora_int_id)

    def check_batch_size(self, max_num_seqs: int, max_model_len: int) -> None:
        if max_num_seqs > self.runner.num_slots or max_model_len > self.runner.max_len:
            raise ConfigError(
                f"persistent batch ({max_num_seqs} slots x {max_model_len}) is larger than the "
                f"backend's KV cache ({self.runner.num_slots} x {self.runner.max_len})"
            )

    def shutdown(self) -> None:
        self.batch = None
        self.thread_binding.enabled = False
        self.thread_binding.apply(torch.get_num_threads())

    def own_thread(self) -> None:
        self.thread_binding.enabled = True
        self.thread_binding.apply(torch.get_num_threads())

    def forward_fills_host_cpus(self) -> bool:
        if self.device.type != "cpu":
            return False
        governor = self.thread_governor
        threads = governor.threads if governor.active else self._max_threads
        cpus = self.thread_binding.cpus  # the CPUs this process may use (none known: not Linux)
        return bool(cpus) and threads >= len(cpus)

    # -- one step ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        batch = self.begin_step(plan)
        if self.lora_stack is not None:
            self._place_adapters(plan, batch, self.lora_stack)
        if self.vlm is not None and any(new.mm_inputs is not None for new in plan.new_requests):
            self._encode_images(plan, batch, self.vlm)
        if self._plain_decode(plan):
            return self.end_step(plan, self._execute_decode(plan, batch, t0))
        rows = _Rows.from_plan(plan)
        if rows.num_rows == 0:
            return StepResult(np.full((0, 1), -1, dtype=np.int64), np.zeros(0, dtype=np.int64))
        token_row = np.repeat(np.arange(rows.num_rows), rows.lens)
        positions = rows.starts[token_row] + np.arange(rows.offsets[-1]) - rows.offsets[token_row]
        token_ids = torch.from_numpy(batch.token_ids[rows.slots[token_row], positions])
        alts = _Alternatives.from_plan(plan, rows, batch, self.device)
        if alts is not None:
            token_ids = torch.cat((token_ids, torch.from_numpy(alts.token_ids)))
        lora = None
        if self.lora_stack is not None:
            token_slots = rows.slots[token_row] if alts is None else np.concatenate(
                (rows.slots[token_row], rows.slots[alts.row])
            )
            lora = self.lora_stack.step(batch.lora_slot[token_slots])
        embeds = cos_sin = None
        if self.vlm is not None and batch.has_images[rows.slots].any():
            # Image rows: Qwen2-VL's features replace image-token embeddings and they rotate by M-RoPE; Mllama's
            # tokens attend to their slot's images in the cross-attention layers (set for the next forward, which
            # then takes the layer path: the fused C forward covers the self-attention layers only).
            token_slots, token_positions = rows.slots[token_row], positions
            if alts is not None:
                token_slots = np.concatenate((token_slots, rows.slots[alts.row]))
                token_positions = np.concatenate((positions, rows.starts[alts.row] + 1))
            embeds, cos_sin = self.vlm.step_inputs(token_ids, token_slots, token_positions, batch)

        t1 = time.perf_counter()
        cpu0 = self._start_forward()
        limit = max(DEFAULT_BATCHED_QUERY_LIMIT, rows.width)  # verification rows share the batched SDPA
        verify_index, verify_valid = rows.verification_positions()
        sampled_positions = torch.from_numpy(verify_index[verify_valid])
        # Only the sampled positions' states are read back, unless a drafter wants every token's, a row wants
        # prompt logprobs, or alternatives ride along: then the forward need not finish the others.
        wants_prompt_logprobs = bool((batch.num_prompt_logprobs[rows.slots] >= 0).any())
        only_sampled = alts is None and not self.keep_hidden_states and not wants_prompt_logprobs
        hidden = self.runner.run(
            token_ids, rows.slots, rows.starts, rows.lens, batched_query_limit=limit,
            alts=None if alts is None else alts.forward, keep=sampled_positions if only_sampled else None,
            on_compute=self.forward_started, lora=lora, embeds=embeds, cos_sin=cos_sin,
        )  # fmt: skip
        sampled_hidden = hidden if only_sampled else hidden[sampled_positions.to(self.device)]
        alt_logits = None
        logits = greedy = None
        if alts is None:
            if (
                rows.sampled.size
                and self._greedy_from_head
                and plan.token_mask is None  # constrained rows need the logits
                and self.sampler.plain_greedy(rows.slots[rows.sampled], batch)
            ):
                # (valid positions,): each row's tokens, and for drafting rows every draft position's
                greedy = self.runner.greedy_tokens(sampled_hidden, self.sampler.vocab_size)
            if rows.sampled.size and greedy is None:
                logits = self.runner.logits(sampled_hidden)
        else:  # one pass over the LM head's weights for the rows' positions and the alternatives
            num_rows_tokens = int(rows.offsets[-1])
            alt_hidden = hidden[num_rows_tokens:]
            hidden = hidden[:num_rows_tokens]
            both = self.runner.logits(torch.cat((sampled_hidden, alt_hidden)))
            logits, alt_logits = both[: sampled_hidden.shape[0]], both[sampled_hidden.shape[0] :]
        prompt_logprobs = self._prompt_logprobs(batch, hidden, rows) if wants_prompt_logprobs else {}

        t2 = time.perf_counter()
        self._end_forward(t2 - t1, cpu0)
        out_tokens = np.full((rows.num_rows, rows.width), -1, dtype=np.int64)
        num_sampled = np.zeros(rows.num_rows, dtype=np.int64)
        logprobs: LogprobsBlock | None = None
        if greedy is not None and rows.width == 1:  # plain greedy rows: the LM head gave the argmax itself
            out_tokens[rows.sampled, 0] = greedy.numpy()
            num_sampled[rows.sampled] = 1
        elif greedy is not None:  # greedy verification from the same argmaxes
            target = torch.zeros(rows.sampled.size, rows.width, dtype=torch.long)  # padding: argmax of zeros
            target[torch.from_numpy(verify_valid)] = greedy
            _, num_drafts, draft_ids = self._drafts(batch, rows)
            accepted = accept_greedy(target, torch.from_numpy(draft_ids), torch.from_numpy(num_drafts))
            out_tokens[rows.sampled] = accepted.token_ids.numpy()
            num_sampled[rows.sampled] = accepted.num_tokens.numpy()
        elif logits is not None:
            if rows.width == 1:  # no drafts anywhere: plain sampling
                out = self.sampler.sample(logits, rows.slots[rows.sampled], batch, _mask(plan, rows))
                out_tokens[rows.sampled, 0] = out.token_ids.cpu().numpy()
                num_sampled[rows.sampled] = 1
                block = _with_width(out.logprobs)
            else:  # every sampled row verifies; rows without drafts verify as plain decodes
                out = self._verify(batch, rows, logits, verify_valid, plan.draft_probs, _mask(plan, rows))
                out_tokens[rows.sampled] = out.token_ids.cpu().numpy()
                num_sampled[rows.sampled] = out.num_tokens.cpu().numpy()
                block = out.logprobs
            logprobs = _scatter_rows(block, rows.sampled, rows.num_rows, rows.width)
        alternative_counts = None
        if alts is not None and alt_logits is not None:
            hits = alts.accepted(out_tokens, num_sampled)
            alternative_counts = (int(alts.row.size), int(hits.size))
            if hits.size:
                rows_hit = alts.row[hits]
                extra = self.sampler.sample(alt_logits[torch.from_numpy(hits).to(self.device)], rows.slots[rows_hit],
                                            batch)
                out_tokens[rows_hit, 1] = extra.token_ids.cpu().numpy()
                num_sampled[rows_hit] = 2
                for a in hits.tolist():
                    alts.forward.install(self.runner.kv_cache, a)
                if self.keep_hidden_states:
                    # The hit's state replaces the rejected draft's: the target's state at that position now.
                    hidden[torch.from_numpy(rows.offsets[rows_hit] + 1).to(self.device)] = alt_hidden[
                        torch.from_numpy(hits).to(self.device)
                    ]
                    sampled_hidden = hidden[torch.from_numpy(verify_index[verify_valid]).to(self.device)]
        t3 = time.perf_counter()

        result = StepResult(
            sampled_token_ids=out_tokens,
            num_sampled=num_sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs or None,
            timings={"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2},
            draft_alternatives=alternative_counts,  # (alternatives run, alternatives that won): metrics, logs
        )
        if self.keep_hidden_states:
            size = hidden.shape[-1]
            padded = hidden.new_zeros(rows.sampled.size, rows.width, size)
            padded[torch.from_numpy(verify_valid).to(self.device)] = sampled_hidden
            states = hidden.new_zeros(rows.num_rows, rows.width, size)
            states[torch.from_numpy(rows.sampled).to(self.device)] = padded
            result.hidden_states = states
            # Every scheduled token's state, rows concatenated (row r at token_offsets[r]:[r + 1]):
            # what an EAGLE drafter needs to extend its own cache over prefill chunks.
            result.token_hidden_states = hidden
            result.token_offsets = rows.offsets
        return self.end_step(plan, result)

    def _start_forward(self) -> float:
        """Set this step's intra-op threads (the governor's choice) and return the thread's CPU time so far."""
        governor = self.thread_governor
        threads = governor.step_threads() if governor.active else self._max_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.thread_binding.apply(threads)
        return time.thread_time()

    def _end_forward(self, seconds: float, cpu0: float) -> None:
        """Tell the governor how long the forward took, in wall time and in this thread's CPU."""
        if self.thread_governor.active:
            self.thread_governor.record(seconds, time.thread_time() - cpu0)

    def _plain_decode(self, plan: StepPlan) -> bool:
        """Whether every row runs one token and samples it, with nothing riding along that the general path's
        extras (drafts, alternatives, adapters, images, hidden states for a drafter, token masks) would handle.
        Prompt logprobs need no look: a row's one token at its prompt's end predicts no prompt token."""
        return (
            plan.draft_alternatives is None
            and plan.token_mask is None
            and self.lora_stack is None
            and self.vlm is None
            and not self.keep_hidden_states
            and plan.num_rows > 0
            and int(plan.num_scheduled.max()) == 1
            and bool(plan.sample.all())
        )

    def _execute_decode(self, plan: StepPlan, batch: PersistentBatch, t0: float) -> StepResult:
        """``execute`` for a plan of plain decode rows (``_plain_decode``): the general path's results, without its
        row bookkeeping (flat token offsets, verification positions, padding and scattering): with
        ``AttentionMetadata``'s decode rows, 0.96x the single-stream CPU step (perf_notes.md)."""
        slots, starts = plan.slots, plan.start_pos
        token_ids = torch.from_numpy(batch.token_ids[slots, starts])
        t1 = time.perf_counter()
        cpu0 = self._start_forward()
        hidden = self.runner.run(token_ids, slots, starts, np.ones_like(slots), on_compute=self.forward_started)
        tokens = None
        if self._greedy_from_head and bool(batch.plain_greedy[slots].all()):
            tokens = self.runner.greedy_tokens(hidden, self.sampler.vocab_size)
        logits = self.runner.logits(hidden) if tokens is None else None
        t2 = time.perf_counter()
        self._end_forward(t2 - t1, cpu0)
        logprobs = None
        if logits is not None:
            out = self.sampler.sample(logits, slots, batch)
            tokens = out.token_ids
            logprobs = _with_width(out.logprobs)
        assert tokens is not None
        return StepResult(
            sampled_token_ids=tokens.cpu().numpy().reshape(-1, 1),
            num_sampled=np.ones(slots.size, dtype=np.int64),
            logprobs=logprobs,
            timings={"prepare": t1 - t0, "forward": t2 - t1, "sample": time.perf_counter() - t2},
        )

    @staticmethod
    def _place_adapters(plan: StepPlan, batch: PersistentBatch, stack: LoraStack) -> None:
        """Point each new request's slot at its adapter's buffer slot, copying the adapter in if needed."""
        for new in plan.new_requests:
            if new.lora is not None:
                in_use = set(batch.lora_slot[batch.active].tolist())
                batch.lora_slot[new.slot] = stack.slot_for(new.lora, in_use)

    def _encode_images(self, plan: StepPlan, batch: PersistentBatch, vlm: Qwen2VLModel | MllamaModel) -> None:
        """The step's new image requests through the vision encoder (one batched call); each slot keeps its
        features and positions (Qwen2-VL) or cross-attention keys and values (Mllama) until the request finishes
        (``PersistentBatch.remove`` drops them)."""
        started = time.perf_counter()
        news = [new for new in plan.new_requests if new.mm_inputs is not None]
        encoded: Sequence[SlotImages | SlotCrossStates] = vlm.encode_new(
            [(new.prompt_token_ids, new.mm_inputs) for new in news if new.mm_inputs]
        )
        for new, images in zip(news, encoded, strict=True):
            batch.has_images[new.slot] = True
            batch.images[new.slot] = images
            batch.rope_delta[new.slot] = images.delta
        self.image_encode_s += time.perf_counter() - started

    def _verify(
        self,
        batch: PersistentBatch,
        rows: _Rows,
        flat_logits: torch.Tensor,
        verify_valid: np.ndarray,
        plan_draft_probs: Any,
        token_mask: TokenMask | None = None,
    ) -> Any:
        device = flat_logits.device
        width = rows.width
        if verify_valid.all():  # every row drafted the most (always so for one stream): a view, no copy
            logits = flat_logits.view(rows.sampled.size, width, flat_logits.shape[-1])
        else:
            logits = flat_logits.new_zeros(rows.sampled.size, width, flat_logits.shape[-1])
            logits[torch.from_numpy(verify_valid).to(device)] = flat_logits
        slots, num_drafts, draft_ids = self._drafts(batch, rows)
        draft_probs = None
        if plan_draft_probs is not None:  # (R, max_drafts, V) over plan rows
            probs = plan_draft_probs
            probs = torch.from_numpy(probs) if isinstance(probs, np.ndarray) else probs
            draft_probs = probs[torch.from_numpy(rows.sampled).to(probs.device), : width - 1].to(device)
        return self.sampler.verify(
            logits,
            torch.from_numpy(draft_ids).to(device),
            torch.from_numpy(num_drafts).to(device),
            slots,
            batch,
            draft_probs,
            token_mask=token_mask,
        )

    @staticmethod
    def _drafts(batch: PersistentBatch, rows: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sampled rows' slots, draft counts and drafts (R, W - 1), -1 padded: each row's last
        num_drafts tokens, read back from the batch."""
        slots = rows.slots[rows.sampled]
        num_drafts = rows.drafts[rows.sampled]
        first_draft = rows.starts[rows.sampled] + rows.lens[rows.sampled] - num_drafts
        col = np.arange(rows.width - 1)[None, :]
        draft_pos = first_draft[:, None] + np.minimum(col, np.maximum(num_drafts[:, None] - 1, 0))
        draft_ids = np.where(col < num_drafts[:, None], batch.token_ids[slots[:, None], draft_pos], -1)
        return slots, num_drafts, draft_ids

    def _prompt_logprobs(self, batch: PersistentBatch, hidden: torch.Tensor, rows: _Rows) -> dict[int, LogprobsBlock]:
        """Row -> logprobs of the prompt tokens that this chunk's positions predict (p + 1 < prompt len)."""
        from nxdserve.engine.sampling.logprobs import compute_logprobs

        slots, starts, lens, offsets = rows.slots, rows.starts, rows.lens, rows.offsets
        wanted = np.flatnonzero(batch.num_prompt_logprobs[slots] >= 0)
        out: dict[int, LogprobsBlock] = {}
        for r in wanted:  # rare (prompt_logprobs requests in prefill), so a loop is fine
            slot, start = int(slots[r]), int(starts[r])
            stop = min(start + int(lens[r]), int(batch.num_prompt_tokens[slot]) - 1)
            if stop <= start:
                continue
            num_top = int(batch.num_prompt_logprobs[slot])
            blocks = []
            for lo in range(start, stop, PROMPT_LOGPROBS_BLOCK):
                hi = min(lo + PROMPT_LOGPROBS_BLOCK, stop)
                h = hidden[offsets[r] + lo - start : offsets[r] + hi - start]
                targets = torch.from_numpy(batch.token_ids[slot, lo + 1 : hi + 1]).to(self.device)
                blocks.append(compute_logprobs(self.runner.logits(h), targets, num_top))
            out[int(r)] = _concat_blocks(blocks)
        return out

    def _warm_up(self) -> None:
        # The first oneDNN GEMMs of each shape are slow; run a small prefill and a decode on slot 0 now
        # so the first request does not pay for it. Slot 0's cache is overwritten by its next prefill.
        # The prompt is arbitrary token ids (not one repeated id): its final hidden states also calibrate the
        # greedy LM-head screen, packed here rather than on the first request.
        n = min(32, self.runner.max_len - 1)
        prompt = (torch.arange(n, dtype=torch.long) * 97 + 1000) % self.model.vocab_size
        prefill = self.runner.run(prompt, np.array([0]), np.array([0]), np.array([n]))
        hidden = self.runner.run(torch.zeros(1, dtype=torch.long), np.array([0]), np.array([n]), np.array([1]))
        self.runner.logits(hidden)
        self.runner.greedy_tokens(prefill, self.model.vocab_size)
        if self.device.type == "cpu":
            choice = choose_small_step_path(self.runner, self.config.cpu.quant_small_steps)
            if choice is not None:
                logger.info("quantized steps of up to %d rows: %s", quant.dense_rows, choice.describe())


@dataclass
class _Rows:
    """A plan's rows as int64 arrays, plus where each row's tokens sit in the flat batch."""

    slots: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    drafts: np.ndarray
    sampled: np.ndarray  # indices of rows that sample
    offsets: np.ndarray  # (R + 1,) row r's tokens are flat positions offsets[r]:offsets[r + 1]
    width: int  # W = 1 + the most drafts of any row

    @classmethod
    def from_plan(cls, plan: StepPlan) -> _Rows:
        lens = np.asarray(plan.num_scheduled, dtype=np.int64)
        drafts = np.asarray(plan.num_drafts, dtype=np.int64)
        sampled = np.flatnonzero(np.asarray(plan.sample, dtype=bool))
        offsets = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        return cls(
            slots=np.asarray(plan.slots, dtype=np.int64),
            starts=np.asarray(plan.start_pos, dtype=np.int64),
            lens=lens,
            drafts=drafts,
            sampled=sampled,
            offsets=offsets,
            width=1 + int(drafts[sampled].max()) if sampled.size else 1,
        )

    @property
    def num_rows(self) -> int:
        return int(self.slots.size)

    def verification_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat positions of each sampled row's last 1 + num_drafts tokens, (N, W), and which are real.
        Pads repeat the row's last real position; they are never read back."""
        num = 1 + self.drafts[self.sampled]
        col = np.arange(self.width)[None, :]
        index = self.offsets[self.sampled + 1, None] - num[:, None] + np.minimum(col, num[:, None] - 1)
        return index, col < num[:, None]


@dataclass
class _Alternatives:
    """A plan's draft alternatives that this step runs: alternative a belongs to plan row ``row[a]``."""

    forward: DraftAlternatives
    row: np.ndarray  # (A,) int64
    token_ids: np.ndarray  # (A,) int64

    @classmethod
    def from_plan(
        cls, plan: StepPlan, rows: _Rows, batch: PersistentBatch, device: torch.device
    ) -> _Alternatives | None:
        table = plan.draft_alternatives
        if table is None:
            return None
        table = np.asarray(table, dtype=np.int64)
        slots = rows.slots
        # Only decode rows with a first draft, and only where the extra token after a hit needs no
        # per-position sampling state (the proposer selects so; this keeps the backend exact regardless).
        usable = (
            (rows.drafts > 0)
            & (rows.lens - rows.drafts == 1)
            & np.asarray(plan.sample, dtype=bool)
            & (batch.num_logprobs[slots] < 0)
            & (batch.num_output_tokens(slots) >= batch.min_tokens[slots])
            & (batch.presence_penalty[slots] == 0)
            & (batch.frequency_penalty[slots] == 0)
            & (batch.repetition_penalty[slots] == 1)
        )
        row, col = np.nonzero((table >= 0) & usable[:, None])
        if row.size == 0:
            return None
        positions = rows.starts[row] + 1  # the first draft's position
        forward = DraftAlternatives(
            slots=torch.from_numpy(slots[row]).to(device), positions=torch.from_numpy(positions).to(device)
        )
        return cls(forward=forward, row=row, token_ids=table[row, col])

    def accepted(self, out_tokens: np.ndarray, num_sampled: np.ndarray) -> np.ndarray:
        """Alternatives that won: their row rejected its first draft and emitted exactly them."""
        return np.flatnonzero((num_sampled[self.row] == 1) & (out_tokens[self.row, 0] == self.token_ids))


def _with_width(block: LogprobsBlock | None) -> LogprobsBlock | None:
    """A sample() block (N, 1+n) as (N, 1, 1+n), the verify layout."""
    if block is None:
        return None
    return LogprobsBlock(block.token_ids[:, None], block.logprobs[:, None], block.ranks[:, None])


def _scatter_rows(block: LogprobsBlock | None, rows: np.ndarray, num_rows: int, width: int) -> LogprobsBlock | None:
    """Place the sampled rows' (N, W, 1+n) block into a (R, W, 1+n) one; other rows get padding
    (id -1, logprob -inf, rank 0, as ``compute_logprobs`` pads)."""
    if block is None:
        return None
    k = block.token_ids.shape[-1]
    token_ids = np.full((num_rows, width, k), -1, dtype=np.int64)
    logprobs = np.full((num_rows, width, k), -np.inf, dtype=np.float32)
    ranks = np.zeros((num_rows, width), dtype=np.int64)
    token_ids[rows] = block.token_ids
    logprobs[rows] = block.logprobs
    ranks[rows] = block.ranks
    return LogprobsBlock(token_ids, logprobs, ranks)


def _concat_blocks(blocks: list[LogprobsBlock]) -> LogprobsBlock:
    if len(blocks) == 1:
        return blocks[0]
    return LogprobsBlock(
        np.concatenate([b.token_ids for b in blocks]),
        np.concatenate([b.logprobs for b in blocks]),
        np.concatenate([b.ranks for b in blocks]),
    )


def _mask(plan: StepPlan, rows: _Rows) -> TokenMask | None:
    """Structured outputs: the plan's token mask over the sampled rows' logits (``rows.width`` positions each)."""
    if plan.token_mask is None:
        return None
    return plan.token_mask.for_logits(rows.sampled, rows.width)
def _vision_language_model(
    model_path: Path, dtype: torch.dtype, device: torch.device, max_len: int
) -> Qwen2VLModel | MllamaModel | None:
    """The folder's model when it is a vision-language model this backend drives (Qwen2-VL, Mllama), else None."""
    from nxdserve.engine.models import mllama, qwen2_vl
    from nxdserve.model_files import load_hf_config

    if not (model_path / "config.json").is_file():
        return None
    model_type = load_hf_config(model_path).model_type
    if model_type in qwen2_vl.MODEL_TYPES:
        return qwen2_vl.Qwen2VLModel.from_pretrained(model_path, dtype, device, max_len).eval()
    if model_type in mllama.MODEL_TYPES:
        return mllama.MllamaModel.from_pretrained(model_path, dtype, device, max_len).eval()
    return None


def _gguf_file(config: EngineConfig) -> Path | None:
    """The .gguf file the model came from: --model's, or the embedded default model's."""
    from nxdserve.model_files import default_gguf_path

    if config.model is None:
        return default_gguf_path()
    return Path(config.model) if str(config.model).endswith(".gguf") else None
