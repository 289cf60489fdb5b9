"""The engine's flags, grouped as vLLM's ``vllm serve --help`` groups them (ModelConfig, LoadConfig, ...)."""

from __future__ import annotations

import argparse

from nxdserve.cli_args.registry import ServeParser
from nxdserve.cli_args.types import json_object, json_value, nullable_int, nullable_str, size
from nxdserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS

BOOL = argparse.BooleanOptionalAction
NO_REMOTE = "nxdserve never downloads and runs no model code from the hub"
GENERATE_ONLY = "nxdserve serves generative (decoder) models only; use vLLM for pooling/embedding models"
OWN_MODEL_CODE = "nxdserve runs its own model code (torch reference or NxD Inference)"
NO_CUDA_GRAPHS = "no CUDA graphs or torch.compile here (the NxD backend compiles ahead of time)"
MOE = "no mixture-of-experts models here"
SINGLE_PROCESS = "one engine process; nothing to distribute"
CACHE_LAYOUT = "the KV cache is one slot of max_model_len per sequence, not paged blocks"
MM_NO_CACHE = "no processor cache: prefix caching reuses an image's KV (docs/multimodal.md)"
LORA = "LoRA adapters are tracked in their own issue; merge the adapter into the weights for now."


def add_model_flags(p: ServeParser) -> None:
    g = p.flag_group("ModelConfig", "Which model, tokenizer and defaults")
    g.add("--model", default=None, note="HF folder, .gguf file, or hub id already in the local HF cache "
          "(default: the embedded SmolLM2-135M-Instruct)")  # fmt: skip
    g.refused("--runner", default="auto", allowed=("generate",), note=GENERATE_ONLY)
    g.refused("--convert", default="auto", allowed=("none",), note=GENERATE_ONLY)
    g.refused("--task", default="auto", allowed=("generate",), note=GENERATE_ONLY + " (--task is deprecated in vLLM)")
    g.add("--tokenizer", type=nullable_str, default=None, note="tokenizer folder or cached hub id, if not the model's")
    g.refused(
        "--tokenizer-mode", default="auto", allowed=("hf",),
        note="nxdserve uses the model's fast (Hugging Face tokenizers) tokenizer; drop the flag",
    )  # fmt: skip
    g.no_effect(
        "--trust-remote-code", action=BOOL, default=False, note=NO_REMOTE + "; supported architectures are built in"
    )
    g.add(
        "--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
        note="weights and compute dtype (half = float16, float = float32); on a .gguf model (the default model "
        "too) a dtype asks for a dense copy instead of the file's own 4-bit blocks",
    )  # fmt: skip
    g.add("--seed", type=int, default=0, note="engine seed for unseeded requests")
    g.refused("--hf-config-path", type=nullable_str, default=None, note="put config.json in the model folder")
    g.add("--allowed-local-media-path", default="",
          note="folder whose files chat image parts may name as file: URLs (off by default)")
    g.add("--allowed-media-domains", nargs="+", default=None,
          note="hosts whose http(s) image URLs the server fetches (none by default: no fetching)")
    g.add("--revision", type=nullable_str, default=None,
          note="branch, tag or commit of a hub id, looked up in the local HF cache (refs/<branch>, snapshots/<rev>)")
    g.no_effect("--code-revision", type=nullable_str, default=None, note=NO_REMOTE)
    g.refused("--rope-scaling", type=json_object, default=None, note="set rope_scaling in the model's config.json")
    g.refused("--rope-theta", type=float, default=None, note="set rope_theta in the model's config.json")
    g.add("--tokenizer-revision", type=nullable_str, default=None, note="revision of a cached hub --tokenizer")
    g.add("--max-model-len", type=size, default=None, note="context length; 1k = 1000, 1K = 1024 "
          "(default: min(model, 2048))")  # fmt: skip
    g.add("--quantization", "-q", type=nullable_str, default=None, choices=[None, *QUANTIZATION_METHODS],
          note="weight-only, online from a dense checkpoint: fp8 (e4m3 per channel), int8 / rtn-int8 (per channel), "
          "int4 (group 32), rtn (4-bit group 128, as vLLM's rtn), int4-g32/64/128; gguf: a .gguf model served "
          "from its own 4-bit blocks (the default for a .gguf model, the default model too, on the torch backend on "
          "a CPU without the fused AVX512-BF16/AMX decoder, when --dtype is not given); compressed-tensors: an "
          "llm-compressor checkpoint from its own codes (auto-detected from config.json); nxd backend: int8 / fp8 "
          "through NxD's per-channel quantization (docs/quantization.md)")  # fmt: skip
    g.add("--quantization-tune-epochs", type=int, default=None,
          note="int4-g128 only (refused with other methods): epochs of tuning its group scales and offsets against the "
          "dense model at load (default 3; "
          "0: none). Each costs about three forwards over ~8000 tokens: ~80 s for the default model on 2 CPU "
          "cores, far longer for large models on a CPU (docs/quantization.md)")  # fmt: skip
    g.no_effect("--enforce-eager", action=BOOL, default=False, note=NO_CUDA_GRAPHS)
    g.add("--max-logprobs", type=int, default=20, note="largest logprobs / top_logprobs a request may ask")
    g.refused("--logprobs-mode", default="raw_logprobs", note="nxdserve returns raw logprobs")
    g.no_effect("--disable-sliding-window", action=BOOL, default=False, note="no sliding-window attention here")
    g.no_effect("--disable-cascade-attn", action=BOOL, default=False, note="no cascade attention here")
    g.refused("--skip-tokenizer-init", action=BOOL, default=False, note="the OpenAI API needs the tokenizer")
    g.refused("--enable-prompt-embeds", action=BOOL, default=False, note="send text or token ids")
    g.add("--served-model-name", nargs="+", default=None,
          note="names clients may use (all listed by /v1/models); the first is reported")
    g.refused("--config-format", default="auto", allowed=("hf",), note="nxdserve reads Hugging Face configs")
    g.no_effect("--hf-token", type=str, nargs="?", const=True, default=None, note=NO_REMOTE)
    g.refused("--hf-overrides", type=json_object, default=None, note="edit the model folder's config.json")
    g.refused("--pooler-config", type=json_object, default=None, note=GENERATE_ONLY)
    g.refused("--override-pooler-config", type=json_object, default=None, note=GENERATE_ONLY)
    g.refused("--logits-processor-pattern", type=nullable_str, default=None, note="no custom logits processors")
    g.add("--generation-config", default="auto",
          note="auto: sampling defaults from the model's generation_config.json; vllm: vLLM's defaults; "
          "a folder: its generation_config.json")  # fmt: skip
    g.add("--override-generation-config", type=json_object, default=None,
          note='JSON merged over the generation config\'s defaults, e.g. \'{"temperature": 0.5}\'')
    g.refused("--enable-sleep-mode", action=BOOL, default=False, note="stop and restart the server instead")
    g.no_effect("--model-impl", default="auto", note=OWN_MODEL_CODE)
    g.refused("--override-attention-dtype", type=nullable_str, default=None, note="use --dtype")
    g.refused("--logits-processors", nargs="+", default=None, note="no custom logits processors")
    g.refused("--io-processor-plugin", type=nullable_str, default=None, note=GENERATE_ONLY)


def add_load_flags(p: ServeParser) -> None:
    g = p.flag_group("LoadConfig", "Loading the weights")
    g.refused("--load-format", default="auto", allowed=("safetensors", "gguf"),
              note="nxdserve loads safetensors folders (and .gguf files); convert the weights to safetensors")
    g.add("--download-dir", type=nullable_str, default=None,
          note="a Hugging Face hub cache folder to look in for hub ids (nothing is downloaded)")
    g.no_effect("--safetensors-load-strategy", default="lazy", note="safetensors are memory-mapped")
    g.no_effect("--model-loader-extra-config", type=json_object, default=None, note="one built-in loader")
    g.no_effect("--ignore-patterns", nargs="+", default=None, note="nothing is downloaded")
    g.no_effect("--use-tqdm-on-load", action=BOOL, default=True, note="progress is logged every 5 s")
    g.no_effect("--pt-load-map-location", default="cpu", note="no .pt weights are loaded")


def add_parallel_flags(p: ServeParser) -> None:
    g = p.flag_group("ParallelConfig", "Parallelism (the data-parallel flags come with the scale-out work)")
    g.no_effect("--distributed-executor-backend", type=nullable_str, default=None, note=SINGLE_PROCESS)
    g.add("--pipeline-parallel-size", "-pp", type=int, default=1,
          note="1 only: no pipeline parallelism; use --tensor-parallel-size on the nxd backend")
    g.add("--tensor-parallel-size", "-tp", type=int, default=1,
          note="NxD tensor parallel degree; on the torch backend one info line (the model runs whole on one device)")
    g.refused("--decode-context-parallel-size", "-dcp", type=int, default=1, note="use --tensor-parallel-size")
    g.no_effect("--enable-expert-parallel", action=BOOL, default=False, note=MOE)
    g.no_effect("--all2all-backend", type=nullable_str, default=None, note=MOE)
    g.no_effect("--enable-dbo", action=BOOL, default=False, note=MOE)
    g.no_effect("--dbo-decode-token-threshold", type=int, default=None, note=MOE)
    g.no_effect("--dbo-prefill-token-threshold", type=int, default=None, note=MOE)
    g.no_effect("--enable-eplb", action=BOOL, default=False, note=MOE)
    g.no_effect("--eplb-config", type=json_object, default=None, note=MOE)
    g.no_effect("--expert-placement-strategy", default="linear", note=MOE)
    g.no_effect("--num-redundant-experts", type=int, default=None, note=MOE)
    g.no_effect("--eplb-window-size", type=int, default=None, note=MOE)
    g.no_effect("--eplb-step-interval", type=int, default=None, note=MOE)
    g.no_effect("--eplb-log-balancedness", action=BOOL, default=None, note=MOE)
    g.no_effect("--max-parallel-loading-workers", type=int, default=None, note=SINGLE_PROCESS)
    g.no_effect("--ray-workers-use-nsight", action=BOOL, default=False, note="no Ray workers")
    g.no_effect("--disable-custom-all-reduce", action=BOOL, default=False, note="NxD runs its own collectives")
    g.refused("--worker-cls", default="auto", note=OWN_MODEL_CODE)
    g.refused("--worker-extension-cls", default="", note=OWN_MODEL_CODE)
    g.no_effect("--enable-multimodal-encoder-data-parallel", action=BOOL, default=False,
                note="the vision encoder runs with the model, whole")


def add_cache_flags(p: ServeParser) -> None:
    g = p.flag_group("CacheConfig", "The KV cache: one slot of max_model_len tokens per sequence")
    g.no_effect("--block-size", type=int, default=None, note=CACHE_LAYOUT)
    g.add("--gpu-memory-utilization", type=float, default=None,
          note="fraction of the device's memory for weights + KV cache: sizes the KV cache, and so the slots "
          "(max_num_seqs is lowered to what fits). On CPU the KV space is VLLM_CPU_KVCACHE_SPACE GiB instead")
    g.add("--kv-cache-memory-bytes", type=nullable_int, default=None,
          note="KV cache size in bytes (4G = 4 GiB); overrides --gpu-memory-utilization; sizes the slots")
    g.no_effect("--swap-space", type=float, default=None, note="no KV swapping: preempted requests recompute")
    g.add("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
          note="KV cache element type: auto = the model dtype; fp8 (= fp8_e4m3) or fp8_e5m2 store K/V in one byte "
          "with per-layer scales (more slots or longer contexts in the same KV space); torch and nxd backends")
    g.no_effect("--num-gpu-blocks-override", type=int, default=None, note=CACHE_LAYOUT)
    g.add("--enable-prefix-caching", action=BOOL, default=False,
          note="a new prompt reuses the KV a free slot still holds for its first tokens (off by default, unlike vLLM)")
    g.no_effect("--prefix-caching-hash-algo", default="sha256", note="prefixes are matched by tokens, not hashes")
    g.no_effect("--cpu-offload-gb", type=float, default=0, note="weights stay on the device")
    g.add("--calculate-kv-scales", action=BOOL, default=False,
          note="with an fp8 --kv-cache-dtype: each layer's K/V scales from the first forward's amax "
          "(/200 for K, /100 for V, as vLLM) instead of 1.0; torch backend")
    g.no_effect("--kv-sharing-fast-prefill", action=BOOL, default=False, note=CACHE_LAYOUT)
    g.no_effect("--mamba-cache-dtype", default="auto", note="no Mamba models here")
    g.no_effect("--mamba-ssm-cache-dtype", default="auto", note="no Mamba models here")
    g.no_effect("--mamba-block-size", type=int, default=None, note="no Mamba models here")


def add_multimodal_and_lora_flags(p: ServeParser) -> None:
    g = p.flag_group("MultiModalConfig", "Media inputs")
    g.add("--limit-mm-per-prompt", type=json_object, default=None,
          note='most images one prompt may hold, e.g. \'{"image": 4}\' (default 999)')
    g.not_yet("--enable-mm-embeds", action=BOOL, default=False, note="send images; embeddings are not taken as input")
    g.not_yet("--media-io-kwargs", type=json_object, default=None, note="images load with the server's own decoder")
    g.not_yet("--mm-processor-kwargs", type=json_object, default=None,
              note="the processor reads the model folder's preprocessor_config.json: set min_pixels / max_pixels "
              "there")
    for name in ("--mm-processor-cache-gb", "--mm-shm-cache-max-object-size-mb"):
        g.no_effect(name, type=float, default=None, note=MM_NO_CACHE)
    g.no_effect("--video-pruning-rate", type=float, default=None, note="images only: no video inputs")
    g.no_effect("--disable-mm-preprocessor-cache", action=BOOL, default=False, note=MM_NO_CACHE)
    g.no_effect("--mm-processor-cache-type", default=None, note=MM_NO_CACHE)
    g.no_effect("--mm-encoder-tp-mode", default=None, note="the vision encoder runs with the model, whole")
    g.no_effect("--mm-encoder-attn-backend", default=None, note=OWN_MODEL_CODE)
    g.no_effect("--interleave-mm-strings", action=BOOL, default=False,
                note="image parts take their place in the message as the chat template renders it")
    g.no_effect("--skip-mm-profiling", action=BOOL, default=False, note="no memory-profiling run at start")

    g = p.flag_group("LoRAConfig", "LoRA adapters (PEFT format), mixed with base-model rows in every batch")
    g.add("--enable-lora", action=BOOL, default=False, note="serve LoRA adapters (--lora-modules, or added later)")
    g.add("--max-loras", type=int, default=None, note="adapters in one batch (the forward's buffer slots; default 1)")
    g.add("--max-lora-rank", type=int, default=None,
          note="largest adapter rank: one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (default 16)")
    g.not_yet("--lora-extra-vocab-size", type=int, default=None, note=LORA)
    g.not_yet("--lora-dtype", default="auto", note=LORA)
    g.add("--max-cpu-loras", type=int, default=None,
          note="adapters kept in host memory, least recently used evicted first (default --max-loras)")
    g.not_yet("--fully-sharded-loras", action=BOOL, default=False, note=LORA)
    g.not_yet("--default-mm-loras", type=json_object, default=None, note=LORA)


def add_scheduler_flags(p: ServeParser) -> None:
    g = p.flag_group("SchedulerConfig", "Continuous batching")
    g.add("--max-num-batched-tokens", type=size, default=None,
          note="tokens per step (default: chunked 512, 128 for the torch backend on CPU; prefill-first "
          "max_model_len)")  # fmt: skip
    g.add("--max-num-seqs", type=int, default=64, note="concurrent sequences (KV slots)")
    g.add("--max-num-partial-prefills", type=int, default=1, note="concurrent partial prefills")
    g.no_effect("--max-long-partial-prefills", type=int, default=None, note="see --max-num-partial-prefills")
    g.add("--long-prefill-token-threshold", type=int, default=0, note="max chunk per request (0: none)")
    g.no_effect("--num-lookahead-slots", type=int, default=None, note="speculation is set by --speculative-config")
    g.add("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
          note="fcfs: arrival order; priority: lowest request `priority` first (ties by arrival), preempting "
          "the worst running request for a better waiting one's slot")
    g.add("--enable-chunked-prefill", action=BOOL, default=True,
          note="chunked prefill mixed with decodes; --no-enable-chunked-prefill: prefill-first")
    g.refused("--disable-chunked-mm-input", action=BOOL, default=False,
              note="a prefill chunk may end inside an image's tokens here; --no-enable-chunked-prefill runs "
              "whole prompts")
    g.refused("--scheduler-cls", type=nullable_str, default=None, note="the scheduler is built in")
    g.no_effect("--disable-hybrid-kv-cache-manager", action=BOOL, default=False, note=CACHE_LAYOUT)
    g.no_effect("--async-scheduling", action=BOOL, default=False,
                note="the engine always schedules the next step while the forward runs")


def add_observability_and_misc_flags(p: ServeParser) -> None:
    g = p.flag_group("ObservabilityConfig", "Metrics and tracing")
    g.no_effect("--show-hidden-metrics-for-version", type=nullable_str, default=None,
                note="/metrics shows the current metric names only")
    g.refused("--otlp-traces-endpoint", type=nullable_str, default=None,
              note="no OpenTelemetry tracing; scrape /metrics instead")
    g.refused("--collect-detailed-traces", type=nullable_str, default=None, note="no OpenTelemetry tracing")
    g.add("--disable-log-stats", action="store_true", note="no periodic throughput log line")
    g.no_effect("--aggregate-engine-logging", action="store_true", note="one engine")

    g = p.flag_group("CompilationConfig", "CUDA graphs and torch.compile")
    g.no_effect("--cudagraph-capture-sizes", type=int, nargs="+", default=None, note=NO_CUDA_GRAPHS)
    g.no_effect("--cuda-graph-sizes", type=int, nargs="+", default=None, note=NO_CUDA_GRAPHS)
    g.no_effect("--max-cudagraph-capture-size", type=int, default=None, note=NO_CUDA_GRAPHS)
    g.no_effect("--compilation-config", "-O", type=json_value, default=None, note=NO_CUDA_GRAPHS)

    g = p.flag_group("VllmConfig", "Speculative decoding and extra engine config")
    g.add("--speculative-config", type=json_object, default=None,
          note='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'')
    g.refused("--kv-transfer-config", type=json_object, default=None, note="no disaggregated prefill")
    g.refused("--kv-events-config", type=json_object, default=None, note="no KV cache events")
    g.add("--additional-config", type=json_object, default=None,
          note='vllm-neuron\'s form: {"override_neuron_config": {...}} is merged into NxD\'s NeuronConfig; '
          "other keys are refused")  # fmt: skip


def add_nxdserve_flags(p: ServeParser) -> None:
    g = p.flag_group("nxdserve", "nxdserve's own flags (no vLLM equivalent)")
    g.add("--backend", default="auto", choices=["auto", "torch", "nxd"],
          note="auto: nxd where NxD Inference and a Neuron device exist, else torch")
    g.add("--device", default="auto", note="torch backend: auto | cpu | cuda")
    g.add("--num-threads", type=int, default=None, note="torch intra-op threads")
    g.add("--override-neuron-config", type=json_object, default=None,
          note="JSON merged into NxD's NeuronConfig; on the torch backend one info line (no effect)")
    g.add("--whole-prompt-overflow", type=int, default=None,
          note="chunked mode: tokens a step may exceed --max-num-batched-tokens by to run a short prompt whole "
          "instead of splitting it (default: 64 with the CPU default budget of 128, else 0)")
    g.add("--max-consecutive-prefill-steps", type=int, default=1,
          note="prefill-first: prefill steps in a row while decodes wait")
    g.add("--max-waiting", type=int, default=None, note="queue bound; beyond it requests get 503")
