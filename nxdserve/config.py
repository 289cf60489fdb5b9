"""Engine configuration: one dataclass with vLLM's field names, resolved once at startup."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from nxdserve.cpu_options import CpuOptions
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

BackendName = Literal["auto", "torch", "nxd"]
SchedulingPolicy = Literal["fcfs", "priority"]
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_CHUNKED_BATCHED_TOKENS = 512
# On a CPU a step costs about its token count (0.5-0.8 ms per token for the default model on 2 cores), so
# a prefill chunk that shares a step with decodes stretches their inter-token latency by its length.
# Measured under a mixed load (24 short requests decoding while 4 x 1500-token prompts arrive), served,
# same session: budget 128 gave the short requests a max ITL 1.6x their median (96: 1.9x; offline 160:
# 4.9x and 192: 6.9x, their single steps with a late long chunk), and against 96 it raised 32-concurrent
# throughput 7% and cut its mean TTFT 12%, 8 concurrent 1000-token prompts' median TTFT 19%.
# (512 holds every short request for a 512-token step: max ITL ~15x the median.)
DEFAULT_CPU_CHUNKED_BATCHED_TOKENS = 128
# With that default, a waiting prompt that fits a whole step runs whole, even past the budget by up to this
# fraction of it, instead of being split: a split short prompt waits a whole extra step for its first token,
# and under a burst of short prompts the queue of split prompts grows. Offline, workload a (64 x 70-token
# prompts, 32 at a time), 4 interleaved runs: mean TTFT 525 -> 430 ms (waves of new prompts while others
# decode: 242 -> 106 ms), throughput equal (618 / 624 tok/s), p99 ITL 90 -> 117 ms; half the budget beat a
# whole one (441 ms, p99 ITL 158). Long prompts (more than a step) are split exactly as before.
DEFAULT_CPU_WHOLE_PROMPT_OVERFLOW = 0.5


# --quantization values (engine.models.quant.METHODS, plus gguf); vLLM's names where vLLM has one.
QUANTIZATION_METHODS = (
    "fp8", "int8", "rtn-int8", "int4", "rtn", "int4-g32", "int4-g64", "int4-g128", "gguf", "compressed-tensors",
)  # fmt: skip

# --kv-cache-dtype values, as vLLM's (fp8 = fp8_e4m3); see engine.models.kv_quant.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded default model (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    backend: BackendName = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # torch backend: auto | cpu | cuda
    max_model_len: int | None = None  # None: min(model's max positions, 2048)
    max_num_seqs: int = 64
    # None: chunked 512 (128 for the torch backend on CPU), prefill-first max_model_len
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # Reuse the KV a free slot still holds when a new prompt starts with the same tokens (see Scheduler).
    enable_prefix_caching: bool = False
    long_prefill_token_threshold: int = 0  # 0: no per-request cap on a chunk
    max_num_partial_prefills: int = 1
    # Chunked mode: tokens a step may run past max_num_batched_tokens to run a waiting prompt whole rather
    # than split it (only prompts that fit one step's budget). None: half the budget where the torch backend
    # runs on a CPU with its default budget, else 0 (an explicit max_num_batched_tokens stays a hard cap, as in vLLM).
    whole_prompt_overflow: int | None = None
    max_consecutive_prefill_steps: int = 1  # prefill-first anti-starvation
    # fcfs: arrival order; priority: lowest request priority first, ties by arrival, and a waiting request may
    # preempt the worst running one for its slot (nxdserve.scheduler.policy).
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_waiting: int | None = None  # None: unbounded queue
    seed: int = 0
    max_logprobs: int = 20
    generation_config: str = "auto"  # auto | vllm | a folder holding generation_config.json
    override_generation_config: dict[str, Any] | None = None  # merged over the generation config's defaults
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    override_neuron_config: dict[str, Any] | None = None
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # Hub ids are looked up in the local Hugging Face cache only (download_dir: a cache root to look in).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # KV cache sizing: when either is set, max_num_seqs is lowered to the slots that fit (see engine.kv_sizing).
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    # KV cache element type (--kv-cache-dtype): auto = the model dtype; fp8 / fp8_e4m3 / fp8_e5m2 store fp8 with
    # per-layer K/V scales, 1.0 unless --calculate-kv-scales sets them from the first forward (kv_quant).
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    disable_log_stats: bool = False
    # LoRA (vLLM's LoRAConfig): adapters resident in the forward's buffers, their maximum rank, and how many
    # stay loaded on the host (None: max_loras), least recently used evicted first.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[Any] = field(default_factory=list)  # nxdserve.lora.LoRARequest, loaded at start
    cpu: CpuOptions = field(default_factory=CpuOptions)  # the torch backend's CPU switches (--cpu-* flags)
    # -- chat templates, tool calling, reasoning, structured outputs (issue 27; flags: nxdserve/tools/flags.py) --
    chat_template: str | None = None  # a file path or inline Jinja; None: the tokenizer's own
    chat_template_content_format: str = "auto"  # auto | string | openai
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | pythonic | a plugin's
    tool_parser_plugin: str | None = None  # a Python file that registers parsers (register_tool_parser)
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3
    # vLLM's --structured-outputs-config: backend (auto | guidance), disable_any_whitespace,
    # disable_additional_properties, enable_in_reasoning
    structured_outputs_config: dict[str, Any] | None = None
    # -- end of issue 27's block --
    data_parallel_size: int = 1  # engine processes behind one API server (nxdserve.engine.dp)
    # Weight format (--quantization): None = dense in ``dtype``; a name in engine.models.quant.METHODS quantizes
    # a dense checkpoint at load; "gguf" keeps a .gguf model's own quantized blocks; "compressed-tensors" a
    # pre-quantized checkpoint's codes (auto-detected from its config.json: engine.models.compressed_tensors).
    # Not given, the torch backend sets it to what it serves: "gguf" for a .gguf model (the default model too)
    # when --dtype is not given either, except where dense is faster or required (engine.backends.weight_format).
    quantization: str | None = None
    # 4-bit groups the scales of which are tuned at load (engine.models.qtune.TUNED_GROUPS, int4-g128): epochs
    # over the tuning texts (None: qtune.EPOCHS; 0: no tuning, the calibrated search alone). Each costs about three
    # forwards of the model over ~8000 tokens (~80 s for the default model on 2 CPU cores).
    quantization_tune_epochs: int | None = None

    def resolve(
        self,
        model_max_positions: int | None,
        backend_max_len: int | None = None,
        chunked_token_budget: int = DEFAULT_CHUNKED_BATCHED_TOKENS,
        on_cpu: bool = False,
    ) -> EngineConfig:
        """Fill defaults that depend on the model and the backend and check the whole config. Returns self.
        ``chunked_token_budget``: the default step budget in chunked mode (the loader passes the CPU one);
        ``on_cpu``: whether the torch backend will run on a CPU (then a default budget gets the whole-prompt
        overflow)."""
        limit = model_max_positions or DEFAULT_MAX_MODEL_LEN
        if backend_max_len is not None:
            limit = min(limit, backend_max_len)
        if self.max_model_len is None:
            self.max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        elif model_max_positions is not None and self.max_model_len > model_max_positions:
            raise ConfigError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={model_max_positions}."
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"--quantization {self.quantization!r}: expected one of {', '.join(QUANTIZATION_METHODS)}."
            )
        epochs = self.quantization_tune_epochs
        if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0):
            raise ConfigError(f"--quantization-tune-epochs must be an int >= 0, got {epochs!r}.")
        if epochs is not None and self.quantization != "int4-g128":  # the one method qtune tunes
            raise ConfigError(
                f"--quantization-tune-epochs applies to --quantization int4-g128 only, not {self.quantization!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}."
            )
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            # checked on every device (vLLM's bound), though only CUDA sizes the KV cache from it
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.whole_prompt_overflow is None:
            cpu_default = on_cpu and self.enable_chunked_prefill and self.max_num_batched_tokens is None
            self.whole_prompt_overflow = (
                int(chunked_token_budget * DEFAULT_CPU_WHOLE_PROMPT_OVERFLOW) if cpu_default else 0
            )
        if self.whole_prompt_overflow < 0:
            raise ConfigError("whole_prompt_overflow must be non-negative.")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                max(chunked_token_budget, self.max_num_seqs)
                if self.enable_chunked_prefill
                else max(self.max_model_len, self.max_num_seqs)
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM refuses to start here; a whole prompt must fit one step, so raise the budget instead.
            logger.info(
                "prefill-first: raising max_num_batched_tokens from %d to max_model_len=%d so any prompt fits "
                "one step",
                self.max_num_batched_tokens,
                self.max_model_len,
            )
            self.max_num_batched_tokens = self.max_model_len
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})."
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be non-negative.")
        if self.max_num_partial_prefills < 1:
            raise ConfigError("max_num_partial_prefills must be at least 1.")
        if self.max_consecutive_prefill_steps < 1:
            raise ConfigError("max_consecutive_prefill_steps must be at least 1.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}.")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ConfigError("max_waiting must be non-negative.")
        return self

    @property
    def scheduling_mode(self) -> str:
        return "chunked" if self.enable_chunked_prefill else "prefill-first"

    @property
    def num_speculative_tokens(self) -> int:
        if not self.speculative_config:
            return 0
        return int(self.speculative_config.get("num_speculative_tokens", 0))
