"""Twenty published ``vllm serve`` command lines, run with only the command name changed.

Hub ids resolve offline through a Hugging Face cache made in the test (HF_HUB_CACHE, ``models--org--name/
refs/main`` + ``snapshots/<commit>``) whose snapshots link to the default model's folder, so the model
argument stays as published. Each line either plans (parses into an EngineConfig and server settings, with
the info lines start-up would log) or fails at once with the message a user should see. Planning runs
in-process; tests/api/test_server_options.py starts real servers from command lines.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from nxdserve import cli
from nxdserve.errors import ConfigError
from nxdserve.model_files import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_IDS = [
    "Qwen/Qwen2.5-1.5B-Instruct", "NousResearch/Meta-Llama-3-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
    "facebook/opt-6.7b", "facebook/opt-125m", "mistralai/Mistral-7B-Instruct-v0.3", "gpt2", "Qwen/Qwen2-7B-Instruct",
    "meta-llama/Llama-2-7b-hf", "openai/gpt-oss-20b", "Qwen/Qwen2.5-VL-3B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
]  # fmt: skip


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF hub cache holding every hub id above (each a link to the default model's folder)."""
    default = resolve_model(None, progress=False)
    cache = tmp_path / "hub"
    for repo_id in HUB_IDS:
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(COMMIT)
        (repo / "snapshots").mkdir()
        (repo / "snapshots" / COMMIT).symlink_to(default, target_is_directory=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("VLLM_API_KEY", "NXDSERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return cache


def plan(command: str) -> tuple[cli.EngineConfig, object, list[str]]:
    """``vllm serve ...`` (or ``python -m vllm.entrypoints.openai.api_server ...``) with the command swapped."""
    argv = shlex.split(command)
    if argv[:2] == ["vllm", "serve"]:
        argv = argv[2:]
        if argv and not argv[0].startswith("-"):
            argv = ["--model", *argv]
    elif argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
        argv = argv[3:]
    else:
        raise AssertionError(f"not a vllm command line: {command}")
    return cli.plan(argv)


# Lines that start: (command, what the plan must hold).
STARTS = [
    # 1. docs.vllm.ai, Getting started > Quickstart ("OpenAI-Compatible Server")
    "vllm serve Qwen/Qwen2.5-1.5B-Instruct",
    # 2. docs.vllm.ai, Serving > OpenAI-Compatible Server (first example)
    "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
    # 3. docs.vllm.ai, Quickstart ("--generation-config vllm" to use vLLM's sampling defaults)
    "vllm serve Qwen/Qwen2.5-1.5B-Instruct --generation-config vllm",
    # 4. docs.vllm.ai, Features > Speculative decoding, n-gram section (server form; vLLM's underscore spellings)
    "vllm serve facebook/opt-6.7b --host localhost --port 8000 --seed 42 -tp 1 --gpu_memory_utilization 0.8 "
    "--speculative_config '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}'",
    # 5. docs.vllm.ai, Getting started > Installation > CPU ("vllm serve facebook/opt-125m --dtype=bfloat16")
    "vllm serve facebook/opt-125m --dtype=bfloat16",
    # 6. docs.vllm.ai, Configuration > Optimization and tuning (chunked prefill and batch limits)
    "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 2048 --max-num-seqs 64 "
    "--max-num-batched-tokens 8192 --enable-chunked-prefill",
    # 7. docs.vllm.ai, Serving > OpenAI-Compatible Server, CLI reference: several names, request logging off
    "vllm serve meta-llama/Llama-3.1-8B-Instruct --served-model-name llama-3.1 gpt-4o-mini "
    "--disable-log-requests --disable-log-stats --uvicorn-log-level warning",
    # 8. Model cards (e.g. DeepSeek-R1-Distill on Hugging Face): "vllm serve ... --tensor-parallel-size 2
    #    --max-model-len 32768 --enforce-eager" (tensor parallel size 1 here: the torch backend)
    "vllm serve deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --max-model-len 2048 --enforce-eager",
    # 9. The flags issue 32 lists as typical, as a user passes them (docs.vllm.ai engine arguments)
    "vllm serve gpt2 --trust-remote-code --gpu-memory-utilization 0.95 --swap-space 16 --block-size 16 "
    "--kv-cache-dtype auto --max-log-len 100 --disable-uvicorn-access-log --tokenizer-mode auto "
    "--load-format auto --revision main --root-path /llm",
    # 10. docs.vllm.ai, Serving > OpenAI-Compatible Server: "--generation-config" / engine arguments:
    #     "--override-generation-config '{\"temperature\": 0.5}'"
    "vllm serve Qwen/Qwen2.5-1.5B-Instruct --override-generation-config '{\"temperature\": 0.5}'",
    # 11. docs.vllm.ai, Usage > Security / CLI serve args: CORS
    "vllm serve Qwen/Qwen2.5-1.5B-Instruct --allowed-origins '[\"https://app.example\"]' "
    "--allowed-methods '[\"GET\", \"POST\"]' --allow-credentials",
    # 12. AWS Neuron docs, vLLM User Guide for NxD Inference (v1): TP 32, 4 sequences, no prefix caching,
    #     NeuronConfig overrides through --additional-config
    "vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 32 --max-num-seqs 4 --max-model-len 128 "
    "--block-size 32 --no-enable-prefix-caching --port 8000 "
    "--additional-config '{\"override_neuron_config\": {\"enable_bucketing\": false}}'",
    # 13. AWS Neuron docs, vLLM V0 User Guide for NxD Inference (legacy): the api_server module, --device neuron
    "python -m vllm.entrypoints.openai.api_server --model meta-llama/Llama-3.1-8B-Instruct --max-num-seqs 4 "
    "--max-model-len 128 --tensor-parallel-size 32 --port 8080 --device neuron "
    "--override-neuron-config '{\"enable_bucketing\": false}'",
    # 17. docs.vllm.ai, Features > LoRA adapters (serving section)
    "vllm serve meta-llama/Llama-2-7b-hf --enable-lora --lora-modules sql-lora=/tmp/sql-lora",
    # 16. docs.vllm.ai, Features > Quantization > Quantized KV cache ("--kv-cache-dtype fp8")
    "vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8",
    # 20. docs.vllm.ai, Features > Multimodal inputs (online serving): "--limit-mm-per-prompt '{\"image\": 2}'"
    "vllm serve Qwen/Qwen2.5-VL-3B-Instruct --limit-mm-per-prompt '{\"image\": 2}'",
    # docs.vllm.ai, Features > Quantization > FP8 W8A8 (issue 29: weight-only fp8 online on the torch backend)
    "vllm serve Qwen/Qwen2-7B-Instruct --quantization fp8",
]


def test_every_start_line_plans(hub_cache: Path) -> None:
    assert len(STARTS) + len(FAILS) == 20
    for command in STARTS:
        plan(command)  # raises on any problem


def test_plans_hold_what_the_lines_say(hub_cache: Path) -> None:
    assert plan(STARTS[-1])[0].quantization == "fp8"
    cfg, opts, infos = plan(STARTS[1])
    assert opts.api_key == "token-abc123" and cfg.dtype == "auto"  # type: ignore[attr-defined]
    cfg, _, _ = plan(STARTS[2])
    assert cfg.generation_config == "vllm"
    cfg, opts, _ = plan(STARTS[3])
    assert (cfg.seed, cfg.gpu_memory_utilization, opts.host, opts.port) == (42, 0.8, "localhost", 8000)  # type: ignore[attr-defined]
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    assert plan(STARTS[4])[0].dtype == "bfloat16"
    cfg, _, _ = plan(STARTS[5])
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (2048, 64, 8192)
    cfg, opts, _ = plan(STARTS[6])
    assert cfg.served_model_name == ["llama-3.1", "gpt-4o-mini"] and cfg.disable_log_stats
    assert opts.log_requests is False and opts.uvicorn_log_level == "warning"  # type: ignore[attr-defined]
    _, _, infos = plan(STARTS[7])
    assert len(infos) == 1 and infos[0].startswith("--enforce-eager has no effect on this engine: no CUDA graphs")
    cfg, opts, infos = plan(STARTS[8])
    assert sorted(line.split()[0] for line in infos) == ["--block-size", "--swap-space", "--trust-remote-code"]
    assert cfg.gpu_memory_utilization == 0.95 and cfg.revision == "main"
    assert (opts.max_log_len, opts.access_log, opts.root_path) == (100, False, "/llm")  # type: ignore[attr-defined]
    assert plan(STARTS[9])[0].override_generation_config == {"temperature": 0.5}
    _, opts, _ = plan(STARTS[10])
    assert opts.allowed_origins == ["https://app.example"] and opts.allowed_methods == ["GET", "POST"]  # type: ignore[attr-defined]
    assert opts.allow_credentials is True  # type: ignore[attr-defined]
    cfg, _, infos = plan(STARTS[11])
    assert cfg.override_neuron_config == {"enable_bucketing": False} and cfg.tensor_parallel_size == 32
    assert cfg.enable_prefix_caching is False and infos[0].startswith("--block-size has no effect")
    cfg, opts, _ = plan(STARTS[12])
    assert (cfg.backend, cfg.device, opts.port) == ("nxd", "auto", 8080)  # type: ignore[attr-defined]
    assert cfg.override_neuron_config == {"enable_bucketing": False}
    _, opts, _ = plan(STARTS[-2])
    assert opts.media.limit_per_prompt == {"image": 2} and opts.media.allowed_media_domains == ()  # type: ignore[attr-defined]
    cfg, _, _ = plan(STARTS[13])
    assert cfg.enable_lora and (cfg.max_loras, cfg.max_lora_rank) == (1, 16)
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in cfg.lora_modules] == [("sql-lora", 1, "/tmp/sql-lora")]
    cfg, _, infos = plan(STARTS[14])
    assert (cfg.kv_cache_dtype, cfg.calculate_kv_scales, infos) == ("fp8", False, [])


# Lines that must fail at once: (command, words the message must hold).
FAILS = [
    # 14. docs.vllm.ai, Serving > Parallelism and scaling: "vllm serve gpt2 --tensor-parallel-size 4
    #     --pipeline-parallel-size 2"
    ("vllm serve gpt2 --tensor-parallel-size 4 --pipeline-parallel-size 2",
     ["--pipeline-parallel-size 2", "--tensor-parallel-size"]),
    # 18. Mistral model cards on Hugging Face: "--tokenizer_mode mistral --config_format mistral --load_format mistral"
    ("vllm serve mistralai/Mistral-7B-Instruct-v0.3 --tokenizer_mode mistral --config_format mistral "
     "--load_format mistral", ["--tokenizer-mode 'mistral'", "drop the flag"]),
    # 19. AWS Neuron docs, vLLM Neuron plugin configuration reference (bucketing through neuron_config)
    ("vllm serve openai/gpt-oss-20b --tensor-parallel-size 8 "
     "--additional-config '{\"neuron_config\": {\"num_batched_tokens_buckets\": [256, 512, 1024]}}'",
     ["neuron_config", "override_neuron_config"]),
]  # fmt: skip


@pytest.mark.parametrize(("command", "words"), FAILS, ids=[f"line{15 + i}" for i in range(len(FAILS))])
def test_unsupported_lines_fail_at_once_saying_why(hub_cache: Path, command: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        plan(command)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_hub_id_without_a_local_copy_fails_naming_where_it_looked(hub_cache: Path) -> None:
    with pytest.raises(ConfigError) as info:
        plan("vllm serve someone/not-cached-model --revision v2")
    message = str(info.value)
    assert "never downloads" in message and "revision v2" in message
    assert str(hub_cache / "models--someone--not-cached-model") in message


def test_main_exits_2_with_the_message(hub_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "gpt2", "--pipeline-parallel-size", "2"])
    assert info.value.code == 2
    assert "--pipeline-parallel-size 2" in capsys.readouterr().err
