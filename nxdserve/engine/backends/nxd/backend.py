"""NxdBackend: the engine's backend contract on an NxD Inference application.

One step is either prefill or decode (``mixed_prefill_decode=False``), which is exactly NxD's
context-encoding / token-generation split:

- a prefill row is one context-encoding call (whole prompt, positions 0..L-1, ``seq_ids=[slot]``);
- decode rows are one token-generation call over every live slot, sorted by seq_id. A live slot the
  plan leaves out is re-run on its last token (rewriting the KV it already has), so NxD never pads
  the batch with rows that write into a live line (unless ``apply_seq_ids_mask`` sends them nowhere).

Sampling (``NxdSettings.sampling_mode``):
- device (default): NxD samples, ``[top_k, top_p, temperature]`` per row. Requests that need more
  (logprobs, min_p, penalties, logit_bias, min_tokens, a seed) are rejected at admission by
  ``validate_request`` with the flag that enables them;
- hybrid (``output_logits: true``): NxD samples and also returns logits; rows that need more are
  sampled again on CPU with nxdserve's Sampler, the others keep NxD's token;
- cpu (``on_device_sampling_config: null``): NxD returns logits and every row is sampled on CPU.
Prompt logprobs are never available: context encoding returns the last position only.

With fused speculation NxD returns 1..k tokens per decode row; they come back in the StepResult as
accepted tokens (the plan itself has no drafts).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.base import Backend
from nxdserve.engine.backends.nxd.app import LoadedApp, load_application, nxd_version
from nxdserve.engine.backends.nxd.inputs import NxdCall, cte_call, sampling_rows, tkg_call
from nxdserve.engine.backends.nxd.neuron_config import (
    DRIVEN_IMAGE_TO_TEXT,
    FUSED_METHODS,
    NxdSettings,
    qwen2_vl_image_grid,
)
from nxdserve.engine.backends.nxd.outputs import read_fused, read_logits, read_tokens
from nxdserve.engine.backends.nxd.request_check import NxdRequestCheck
from nxdserve.engine.mm_inputs import MultiModalInputs
from nxdserve.engine.models.compressed_tensors import resolve_quantization
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.engine.sampling.sampler import Sampler
from nxdserve.engine.step import BackendCapabilities, FusedSpecResult, LogprobsBlock, StepPlan, StepResult
from nxdserve.engine.structured.mask import StepTokenMask
from nxdserve.errors import ConfigError, InvalidRequestError, LoRAAdapterError
from nxdserve.model_files import load_hf_config
from nxdserve.sampling_params import GREEDY_EPS, SamplingParams

logger = logging.getLogger(__name__)

LAST_RELEASE_WITH_CHUNKED_PREFILL = (0, 7)


class NxdBackend(Backend):
    name = "nxd"
    reports_forward_start = True

    def __init__(self, model_path: Path, config: EngineConfig, loaded: LoadedApp | None = None) -> None:
        if config.max_model_len is None:
            raise ConfigError("NxdBackend needs a resolved EngineConfig (max_model_len is unset).")
        # --quantization maps onto NxD's own keys (neuron_config.quantization_neuron_config); a pre-quantized
        # checkpoint is detected as on torch, then refused there with what to use instead.
        config.quantization = resolve_quantization(config.quantization, model_path)
        hf_config = load_hf_config(model_path)
        self.loaded = loaded or load_application(model_path, config, hf_config)
        self.app = self.loaded.app
        self.settings: NxdSettings = self.loaded.settings
        s = self.settings
        text_config = getattr(hf_config, "text_config", None) or hf_config
        self.vocab_size = int(text_config.vocab_size)
        num_seqs = min(config.max_num_seqs, s.batch_size)
        max_model_len = min(config.max_model_len, s.max_model_len)
        if max_model_len < config.max_model_len:
            logger.warning(
                "NxD: requests are limited to %d tokens (max_model_len %d): %s",
                max_model_len, config.max_model_len,
                f"fused speculation (k={s.speculation_length}) must fit inside the largest token-generation "
                f"bucket, {s.tkg_buckets_largest}" if s.fused
                else f"the largest compiled token-generation bucket is {s.tkg_buckets_largest}",
            )
        _fall_back_from_chunked_prefill(config)
        eos = getattr(text_config, "eos_token_id", None)
        # Qwen2-VL: the compiled encoder's image grid and most images per prompt (its vision buckets).
        self.image_grid: tuple[int, int, int] | None = None
        self.max_images = 0
        if getattr(hf_config, "model_type", None) in DRIVEN_IMAGE_TO_TEXT:
            vnc = self.app.vision_config.neuron_config  # NxD sets it on the application
            self.image_grid = qwen2_vl_image_grid(int(vnc.default_image_width), int(vnc.default_image_height),
                                                  int(hf_config.vision_config.patch_size))  # fmt: skip
            self.max_images = int(max(vnc.buckets))
        self.slot_images: dict[int, MultiModalInputs] = {}  # the prompt images of slots still to context-encode
        self._caps = BackendCapabilities(
            max_num_seqs=num_seqs,
            max_model_len=max_model_len,
            max_prompt_len=s.cte_buckets_largest,
            vocab_size=self.vocab_size,
            mixed_prefill_decode=False,
            chunked_prefill=False,
            decode_all_live_slots=True,
            max_prefills_per_step=1,
            fused_spec_methods=FUSED_METHODS,
            supports_draft_verification=False,
            global_top_k=s.global_topk,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            image_inputs=self.image_grid is not None,
        )
        self.sampler = Sampler(self.vocab_size, torch.device("cpu"), seed=config.seed)
        self.kv_len = np.zeros(num_seqs, dtype=np.int64)  # positions with valid KV, per line
        self._needs_cpu = np.zeros(num_seqs, dtype=bool)
        self._needs_cpu_version = -1
        self._warned_slots: set[int] = set()
        self._token_mask: StepTokenMask | None = None
        if self.image_grid is not None:  # Qwen2-VL's decoder is Qwen2's; only its rotary positions differ
            text_config = copy.copy(text_config)
            setattr(text_config, "model_type", "qwen2")  # noqa: B010 - an instance attribute over the class's
        self.model_spec = ModelSpec.from_hf_config(text_config)
        # LoRA: NxD's compiled adapter index of each --lora-modules adapter (0 is the zero adapter).
        self.lora_index = {m.lora_name: i + 1 for i, m in enumerate(config.lora_modules)} if config.enable_lora else {}
        self._lora_paths = {m.lora_name: m.lora_path for m in config.lora_modules}
        logger.info("NxD backend ready: sampling %s, %d slots, max_model_len %d", s.sampling_mode, num_seqs,
                    max_model_len)

    # -- contract ----------------------------------------------------------------------------------
    def lora_model_spec(self) -> ModelSpec:
        return self.model_spec

    def check_lora(self, name: str, path: str) -> None:
        if self._lora_paths.get(name) != path:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} ({path}) was not compiled into the NxD model: the nxd backend serves only "
                f"the --lora-modules adapters ({sorted(self._lora_paths)}); NxD's LoRA weights are fixed at "
                "compile time here (use the torch backend for adapters added at run time).",
                param="lora_name",
            )

    @property
    def capabilities(self) -> BackendCapabilities:
        return self._caps

    def check_batch_size(self, max_num_seqs: int, max_model_len: int) -> None:
        if max_num_seqs > self.kv_len.shape[0]:
            raise ConfigError(f"{max_num_seqs} slots but NxD was compiled for batch {self.kv_len.shape[0]}")

    def validate_request(self, params: SamplingParams) -> None:
        """Admission check: raise InvalidRequestError for what this NxD configuration cannot serve."""
        self.request_check()(params)

    def request_check(self) -> NxdRequestCheck:
        return NxdRequestCheck(self.settings.sampling_mode, self.settings.fused)

    def validate_images(self, mm_inputs: MultiModalInputs) -> None:
        """NxD's Qwen2-VL encoder is compiled for one image size and at most its largest vision bucket of
        images per prompt: anything else is a 400 at admission, not an error inside NxD."""
        param = "multi_modal_data.image"
        if self.image_grid is None:
            raise InvalidRequestError("the served model is a text-only model and takes no images.", param=param)
        if mm_inputs.num_images > self.max_images:
            raise InvalidRequestError(
                f"{mm_inputs.num_images} images in one prompt, but the NxD vision encoder was compiled for at "
                f"most {self.max_images} (vision_neuron_config buckets).", param=param,
            )  # fmt: skip
        for k, grid in enumerate(mm_inputs.image_grid_thw.tolist()):
            if tuple(grid) != self.image_grid:
                _, h, w = self.image_grid
                raise InvalidRequestError(
                    f"image {k} becomes a {grid[1]}x{grid[2]} patch grid, but the NxD Qwen2-VL vision encoder "
                    f"was compiled for {h}x{w} (its vision_neuron_config default_image_width/height): send "
                    "images of that size, or compile for another with --override-neuron-config "
                    "'{\"vision_neuron_config\": {\"default_image_width\": W, \"default_image_height\": H}}'.",
                    param=param,
                )

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self.begin_step(plan)
        assert self.batch is not None
        for slot in (*plan.freed_slots, *plan.new_slots):
            self.kv_len[slot] = 0
            self.slot_images.pop(int(slot), None)
        for new in plan.new_requests:
            if new.mm_inputs is not None:
                self.slot_images[new.slot] = new.mm_inputs
        for new in plan.new_requests:
            if new.lora is not None:
                self.batch.lora_slot[new.slot] = self.lora_index[new.lora.name]
        if np.any(plan.num_drafts > 0):
            raise RuntimeError("the nxd backend does not verify engine drafts; NxD speculation runs fused on device")
        self._token_mask = plan.token_mask  # structured outputs: those rows are sampled on the host
        width = max(1, self.settings.speculation_length)
        step = _StepOutputs(plan.num_rows, width)
        prefill = plan.start_pos < self.batch.num_prompt_tokens[plan.slots]
        for row in np.flatnonzero(prefill):
            self._context_encode(plan, int(row), step)
        decode_rows = np.flatnonzero(~prefill)
        if decode_rows.size:
            self._token_generate(plan, decode_rows, step)
        step.timings["total"] = time.perf_counter() - started
        return self.end_step(plan, step.result())

    # -- context encoding --------------------------------------------------------------------------
    def _context_encode(self, plan: StepPlan, row: int, step: _StepOutputs) -> None:
        assert self.batch is not None
        slot, start, n = int(plan.slots[row]), int(plan.start_pos[row]), int(plan.num_scheduled[row])
        # The slot's tokens: its prompt, and for a request resumed after a preemption its outputs too.
        length = int(self.batch.num_tokens[slot])
        if start != 0 or n != length:
            raise RuntimeError(
                f"NxD context encoding runs a whole prompt in one call; got positions {start}..{start + n} of a "
                f"{length}-token prompt (slot {slot})"
            )
        t0 = time.perf_counter()
        slots = np.array([slot], dtype=np.int64)
        call = cte_call(self.batch.token_ids[slot, :length], slot, self._sampling_rows(slots),
                        self.settings.cte_buckets_largest, self.settings.pad_token_id)
        call.adapter_ids = self._adapter_ids(slots)
        images = self.slot_images.pop(slot, None)  # a preempted request's images come back with it
        if images is not None:
            call.pixel_values, call.image_grid_thw = images.pixel_values, images.image_grid_thw
        step.timings["prepare"] += time.perf_counter() - t0
        output = self._forward(call, step)
        self.kv_len[slot] = length
        self._collect(output, np.array([row]), slots, np.array([length - 1]), step)

    # -- token generation --------------------------------------------------------------------------
    def _token_generate(self, plan: StepPlan, rows: np.ndarray, step: _StepOutputs) -> None:
        assert self.batch is not None
        t0 = time.perf_counter()
        slots = plan.slots[rows]
        starts = plan.start_pos[rows]
        if np.any(plan.num_scheduled[rows] != 1):
            raise RuntimeError("NxD token generation runs one token per slot per step")
        if np.any(starts != self.kv_len[slots]):
            raise RuntimeError(f"decode positions {starts.tolist()} do not follow the KV in lines {slots.tolist()}")
        tokens = self.batch.token_ids[slots, starts]
        replay = self._missing_live_slots(slots)
        if replay.size:
            # Rewrites KV the line already holds (same token, same position): keeps pad rows out of it.
            replay_pos = self.kv_len[replay] - 1
            slots = np.concatenate([slots, replay])
            starts = np.concatenate([starts, replay_pos])
            tokens = np.concatenate([tokens, self.batch.token_ids[replay, replay_pos]])
        order = np.argsort(slots, kind="stable")
        slots, starts, tokens = slots[order], starts[order], tokens[order]
        self._check_positions(starts)
        call = tkg_call(tokens, starts, slots, self._sampling_rows(slots))
        call.adapter_ids = self._adapter_ids(slots)
        step.timings["prepare"] += time.perf_counter() - t0
        output = self._forward(call, step)
        # Position of each plan row inside the sorted call.
        where = np.empty(order.size, dtype=np.int64)
        where[order] = np.arange(order.size)
        in_call = where[: rows.size]
        counts = self._collect(output, rows, slots[in_call], starts[in_call], step, in_call)
        self.kv_len[slots[in_call]] = starts[in_call] + counts

    def _adapter_ids(self, slots: np.ndarray) -> torch.Tensor | None:
        """Each row's compiled adapter index (0: base), when the model was compiled with LoRA."""
        if not self.lora_index:
            return None
        assert self.batch is not None
        ids = np.maximum(self.batch.lora_slot[slots], 0)  # lora_slot holds the index here; -1: base
        return torch.from_numpy(ids.astype(np.int32))

    def _missing_live_slots(self, slots: np.ndarray) -> np.ndarray:
        if self.settings.seq_ids_mask:  # NxD's pad rows write nowhere
            return np.zeros(0, dtype=np.int64)
        assert self.batch is not None
        live = np.flatnonzero(self.batch.active[: self.kv_len.shape[0]] & (self.kv_len > 0))
        missing = np.setdiff1d(live, slots)
        if missing.size:
            logger.debug("NxD: re-running live slots %s left out of a decode step", missing.tolist())
        return missing

    def _check_positions(self, positions: np.ndarray) -> None:
        # Admission keeps every request inside these bounds; this turns a violation into a clear error
        # instead of NxD's bucket ValueError.
        limit = self.settings.max_length - max(self.settings.speculation_length, 1)
        if positions.size and int(positions.max()) > limit:
            raise RuntimeError(f"decode position {int(positions.max())} is past NxD's limit {limit}")

    # -- shared ------------------------------------------------------------------------------------
    def _forward(self, call: NxdCall, step: _StepOutputs) -> Any:
        t0 = time.perf_counter()
        if self.forward_started is not None:
            self.forward_started()
        with torch.inference_mode():
            output = self.app(**call.kwargs())
        step.timings["forward"] += time.perf_counter() - t0
        return output

    def _sampling_rows(self, slots: np.ndarray) -> torch.Tensor:
        assert self.batch is not None
        b = self.batch
        return sampling_rows(b.temperature[slots], b.top_k[slots], b.top_p[slots], self.settings.global_topk)

    def _collect(
        self,
        output: Any,
        rows: np.ndarray,
        slots: np.ndarray,
        last_positions: np.ndarray,
        step: _StepOutputs,
        in_call: np.ndarray | None = None,
    ) -> np.ndarray:
        """Write the tokens of plan ``rows`` (``in_call``: their rows in the NxD batch) into ``step``;
        returns how many tokens each row produced."""
        assert self.batch is not None
        t0 = time.perf_counter()
        idx = np.arange(rows.size) if in_call is None else in_call
        if self.settings.fused:
            tokens, counts = read_fused(output, idx, last_positions)
            step.put(rows, tokens, counts)
            if in_call is not None:  # a verification step: k - 1 drafts proposed per row, counts - 1 kept
                step.fused_accepted[rows] = counts - 1
            step.timings["sample"] += time.perf_counter() - t0
            return counts
        mode = self.settings.sampling_mode
        on_cpu = np.ones(rows.size, dtype=bool) if mode == "cpu" else np.zeros(rows.size, dtype=bool)
        if mode == "hybrid":
            on_cpu = self._rows_needing_cpu(slots)
        elif mode == "device":
            self._warn_unsupported(slots)
        token_mask = None
        if self._token_mask is not None and mode != "device":
            constrained = np.isin(rows, self._token_mask.rows)
            on_cpu |= constrained
            token_mask = self._token_mask.restrict(rows[on_cpu]).for_logits(rows[on_cpu], 1)
        chosen = np.zeros(rows.size, dtype=np.int64)
        if not on_cpu.all():
            chosen[~on_cpu] = read_tokens(output)[idx[~on_cpu]]
        if on_cpu.any():
            logits = read_logits(output, self.vocab_size)[torch.from_numpy(idx[on_cpu])]
            sampled = self.sampler.sample(logits, slots[on_cpu], self.batch, token_mask)
            chosen[on_cpu] = sampled.token_ids.numpy()
            if sampled.logprobs is not None:
                step.put_logprobs(rows[on_cpu], sampled.logprobs)
        counts = np.ones(rows.size, dtype=np.int64)
        step.put(rows, chosen[:, None], counts)
        step.timings["sample"] += time.perf_counter() - t0
        return counts

    def _rows_needing_cpu(self, slots: np.ndarray) -> np.ndarray:
        b = self.batch
        assert b is not None
        if self._needs_cpu_version != b.version:  # recomputed only when requests come or go
            n = self._needs_cpu.shape[0]
            t = b.temperature[:n] >= GREEDY_EPS
            self._needs_cpu = (
                (b.num_logprobs[:n] >= 0)
                | (b.min_p[:n] > 0)
                | (b.presence_penalty[:n] != 0)
                | (b.frequency_penalty[:n] != 0)
                | (b.repetition_penalty[:n] != 1)
                | (b.min_tokens[:n] > 0)
                | np.array([bias is not None for bias in b.logit_bias[:n]])
                | (np.array([g is not None for g in b.generators[:n]]) & t)
            )
            self._needs_cpu_version = b.version
        return self._needs_cpu[slots]

    def _warn_unsupported(self, slots: np.ndarray) -> None:
        """Device sampling only: a request that needed CPU sampling got past admission (the engine did
        not call ``validate_request``). Serve it with what NxD can do, and say so once."""
        assert self.batch is not None
        needs = self._rows_needing_cpu(slots)
        for slot in slots[needs].tolist():
            if slot not in self._warned_slots:
                self._warned_slots.add(slot)
                logger.warning("NxD: slot %d asks for sampling features on-device sampling ignores", slot)
        self._warned_slots.intersection_update(np.flatnonzero(self.batch.active).tolist())


class _StepOutputs:
    """The StepResult under construction: tokens, counts, logprobs and timings per plan row."""

    def __init__(self, num_rows: int, width: int) -> None:
        self.tokens = np.full((num_rows, width), -1, dtype=np.int64)
        self.counts = np.zeros(num_rows, dtype=np.int64)
        self.logprobs: list[tuple[np.ndarray, LogprobsBlock]] = []
        self.timings = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}
        self.fused_accepted = np.full(num_rows, -1, dtype=np.int64)  # -1: not a fused verification row

    def put(self, rows: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        self.tokens[rows, : tokens.shape[1]] = tokens
        self.counts[rows] = counts

    def put_logprobs(self, rows: np.ndarray, block: LogprobsBlock) -> None:
        self.logprobs.append((rows, block))

    def result(self) -> StepResult:
        # Fused speculation happens inside NxD, so the plan carries no drafts; its acceptance comes back for
        # metrics: drafts accepted per row (-1 for rows that were not verification rows).
        fused = None
        if np.any(self.fused_accepted >= 0):
            fused = FusedSpecResult(accepted_drafts=self.fused_accepted, num_drafts=self.tokens.shape[1] - 1)
        return StepResult(
            sampled_token_ids=self.tokens, num_sampled=self.counts, logprobs=self._logprobs(), timings=self.timings,
            fused_spec=fused,
        )

    def _logprobs(self) -> LogprobsBlock | None:
        """Blocks of single-token rows (m, 1 + n_i) -> one (R, W, 1 + max n) block."""
        if not self.logprobs:
            return None
        rows_total, width = self.tokens.shape
        cols = max(block.token_ids.shape[-1] for _, block in self.logprobs)
        ids = np.full((rows_total, width, cols), -1, dtype=np.int64)
        lps = np.zeros((rows_total, width, cols), dtype=np.float32)
        ranks = np.zeros((rows_total, width), dtype=np.int64)
        for rows, block in self.logprobs:
            n = block.token_ids.shape[-1]
            ids[rows, 0, :n] = np.asarray(block.token_ids).reshape(len(rows), n)
            lps[rows, 0, :n] = np.asarray(block.logprobs).reshape(len(rows), n)
            ranks[rows, 0] = np.asarray(block.ranks).reshape(len(rows))
        return LogprobsBlock(token_ids=ids, logprobs=lps, ranks=ranks)


def _fall_back_from_chunked_prefill(config: EngineConfig) -> None:
    """Chunked prefill needs NxD's block-KV chunked-prefill model (NxDI <= 0.7) or its prefix-caching
    path; this backend drives contiguous KV lines, so it schedules prefill-first and says why, once.

    The config is switched to prefill-first here (rather than only clearing the capability) so the
    scheduler also gets prefill-first's token budget: at least max_model_len, or a long prompt
    would wait forever for a budget it can never have.
    """
    if not config.enable_chunked_prefill:
        return
    version = nxd_version()
    try:
        has_chunked = tuple(int(p) for p in version.split(".")[:2]) <= LAST_RELEASE_WITH_CHUNKED_PREFILL
    except ValueError:
        has_chunked = False
    reason = (
        f"NxD Inference {version} has block-KV chunked prefill, but nxdserve drives the contiguous KV layout"
        if has_chunked
        else f"NxD Inference {version} has no chunked prefill (removed in 0.8)"
    )
    assert config.max_model_len is not None
    budget = max(config.max_num_batched_tokens or 0, config.max_model_len, config.max_num_seqs)
    logger.warning(
        "NxD: %s; scheduling prefill-first instead (whole prompts in single context-encoding steps, "
        "token budget %d). Pass --no-enable-chunked-prefill to silence this.",
        reason, budget,
    )
    config.enable_chunked_prefill = False
    config.max_num_batched_tokens = budget
