"""The flag table: every vLLM 0.11+ ``vllm serve`` flag parses; each class behaves as docs/flags.md says
(no effect: one info line; refused / not yet: start-up stops naming the flag); the docs table is current."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from nxdserve import cli
from nxdserve.api.server import _ExcludePaths
from nxdserve.api.state import ServerState
from nxdserve.cli_args import Flag, flags_markdown
from nxdserve.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _words(text: str) -> list[str]:
    return text.split()


# vLLM 0.11's serve flags (vllm/engine/arg_utils.py EngineArgs.add_cli_args and
# vllm/entrypoints/openai/cli_args.py FrontendArgs), less those other branches own: the chat template, tool
# and reasoning flags (structured outputs) and the data-parallel family (scale-out).
VLLM_FLAGS = _words(
    """
    --host --port --uds --uvicorn-log-level --disable-uvicorn-access-log --disable-access-log-for-endpoints
    --allow-credentials --allowed-origins --allowed-methods --allowed-headers --api-key --lora-modules
    --response-role --ssl-keyfile --ssl-certfile --ssl-ca-certs --enable-ssl-refresh --ssl-cert-reqs --ssl-ciphers
    --root-path --middleware --return-tokens-as-token-ids --disable-frontend-multiprocessing
    --enable-request-id-headers --tool-server --log-config-file --max-log-len --disable-fastapi-docs
    --enable-prompt-tokens-details --enable-server-load-tracking --enable-force-include-usage
    --enable-tokenizer-info-endpoint --enable-log-outputs --h11-max-incomplete-event-size --h11-max-header-count
    --log-error-stack --config --model --runner --convert --task --tokenizer --tokenizer-mode --trust-remote-code
    --dtype --seed --hf-config-path --allowed-local-media-path --allowed-media-domains --revision --code-revision
    --rope-scaling --rope-theta --tokenizer-revision --max-model-len --quantization -q --enforce-eager
    --max-logprobs --logprobs-mode --disable-sliding-window --disable-cascade-attn --skip-tokenizer-init
    --enable-prompt-embeds --served-model-name --config-format --hf-token --hf-overrides --pooler-config
    --override-pooler-config --logits-processor-pattern --generation-config --override-generation-config
    --enable-sleep-mode --model-impl --override-attention-dtype --logits-processors --io-processor-plugin
    --load-format --download-dir --safetensors-load-strategy --model-loader-extra-config --ignore-patterns
    --use-tqdm-on-load --pt-load-map-location --distributed-executor-backend --pipeline-parallel-size -pp
    --tensor-parallel-size -tp --decode-context-parallel-size -dcp --enable-expert-parallel --all2all-backend
    --enable-dbo --dbo-decode-token-threshold --dbo-prefill-token-threshold --enable-eplb --eplb-config
    --expert-placement-strategy --num-redundant-experts --eplb-window-size --eplb-step-interval
    --eplb-log-balancedness --max-parallel-loading-workers --ray-workers-use-nsight --disable-custom-all-reduce
    --worker-cls --worker-extension-cls --enable-multimodal-encoder-data-parallel --block-size
    --gpu-memory-utilization --kv-cache-memory-bytes --swap-space --kv-cache-dtype --num-gpu-blocks-override
    --enable-prefix-caching --prefix-caching-hash-algo --cpu-offload-gb --calculate-kv-scales
    --kv-sharing-fast-prefill --mamba-cache-dtype --mamba-ssm-cache-dtype --mamba-block-size --limit-mm-per-prompt
    --enable-mm-embeds --media-io-kwargs --mm-processor-kwargs --mm-processor-cache-gb
    --disable-mm-preprocessor-cache --mm-processor-cache-type --mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode
    --mm-encoder-attn-backend --interleave-mm-strings --skip-mm-profiling --video-pruning-rate --enable-lora
    --max-loras --max-lora-rank --lora-extra-vocab-size --lora-dtype --max-cpu-loras --fully-sharded-loras
    --default-mm-loras --show-hidden-metrics-for-version --otlp-traces-endpoint --collect-detailed-traces
    --max-num-batched-tokens --max-num-seqs --max-num-partial-prefills --max-long-partial-prefills
    --long-prefill-token-threshold --num-lookahead-slots --scheduling-policy --enable-chunked-prefill
    --disable-chunked-mm-input --scheduler-cls --disable-hybrid-kv-cache-manager --async-scheduling
    --cudagraph-capture-sizes --cuda-graph-sizes --max-cudagraph-capture-size --compilation-config -O
    --speculative-config --kv-transfer-config --kv-events-config --additional-config --disable-log-stats
    --aggregate-engine-logging --enable-log-requests --disable-log-requests
    """
)


@pytest.fixture(scope="module")
def parser() -> cli.ServeParser:
    return cli.build_parser()


def test_every_vllm_flag_is_accepted(parser: cli.ServeParser) -> None:
    known = set(parser._option_string_actions)
    assert [flag for flag in VLLM_FLAGS if flag not in known] == []


def test_help_lists_every_flag(parser: cli.ServeParser) -> None:
    text = parser.format_help()
    missing = [name for flag in parser.flags for name in flag.names if name not in text]
    assert missing == []


def test_docs_table_is_current(parser: cli.ServeParser) -> None:
    """Regenerate with: python -m nxdserve.cli_args > docs/flags.md"""
    assert (REPO / "docs" / "flags.md").read_text() == flags_markdown(parser.flags)


def _sample_argv(flag: Flag, action: argparse.Action) -> list[str]:
    """A command line that gives ``flag`` a value other than its no-op default."""
    name = flag.name
    if action.nargs == 0:  # store_true / BooleanOptionalAction
        return [name] if flag.default is not True else [f"--no-{name[2:]}"]
    if action.choices:
        value = next(str(c) for c in action.choices if c != flag.default and c not in flag.allowed)
    elif action.type is int or action.type is float:
        value = "3"
    elif getattr(action.type, "__name__", "") in ("json_object", "json_value"):
        value = '{"x": 1}'
    elif getattr(action.type, "__name__", "") == "nullable_int":
        value = "1G"
    else:
        value = "some-value"
    return [name, value]


def test_each_class_behaves_as_documented(parser: cli.ServeParser) -> None:
    actions = {a.dest: a for a in parser._actions}
    checked = 0
    for flag in parser.flags:
        if flag.kind == "implemented":
            continue
        argv = _sample_argv(flag, actions[flag.dest])
        if flag.kind == "no effect":
            _, _, infos = cli.plan(argv)
            assert infos == [f"{flag.name} has no effect on this engine: {flag.note}"], argv
        else:
            with pytest.raises(ConfigError) as info:
                cli.plan(argv)
            assert str(info.value).startswith(flag.name) and flag.note in str(info.value), argv
        assert not flag.is_set(flag.default)
        checked += 1
    assert checked > 100


def test_no_op_values_pass_silently() -> None:
    for argv in (["--kv-cache-dtype", "auto"], ["--quantization", "gguf", "--model", "/m/x.gguf"],
                 ["--load-format", "safetensors"], ["--pipeline-parallel-size", "1"], ["--runner", "generate"],
                 ["--tokenizer-mode", "auto"], ["--scheduling-policy", "fcfs"], ["--no-enable-lora"]):  # fmt: skip
        assert cli.plan(argv)[2] == [], argv


def test_api_key_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "vllm-env")
    monkeypatch.setenv("NXDSERVE_API_KEY", "nxd-env")
    assert cli.plan([])[1].api_key == "vllm-env"
    monkeypatch.delenv("VLLM_API_KEY")
    assert cli.plan([])[1].api_key == "nxd-env"
    assert cli.plan(["--api-key", "a", "b"])[1].api_key == ["a", "b"]


def test_server_switches_map_to_options() -> None:
    _, opts, _ = cli.plan(
        ["--no-uvloop", "--disable-fastapi-docs", "--disable-access-log-for-endpoints", "/health, /metrics",
         "--enable-log-requests", "--uvicorn-log-level", "error", "--h11-max-incomplete-event-size", "1024"]
    )  # fmt: skip
    assert (opts.uvloop, opts.enable_docs, opts.access_log_exclude) == (False, False, ["/health", "/metrics"])
    assert (opts.log_requests, opts.uvicorn_log_level, opts.h11_max_incomplete_event_size) == (True, "error", 1024)
    assert cli.plan(["--disable-log-requests"])[1].log_requests is False
    assert cli.plan(["--no-enable-log-requests"])[1].log_requests is False


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--ssl-keyfile", "/no/key.pem"], "must be given together"),
        (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"], "no such file"),
        (["--additional-config", '{"other": 1}'], "only override_neuron_config"),
        (["--generation-config", "/no/such/folder"], "generation_config.json"),
        (["--quantization", "gguf", "--model", "/m"], ".gguf file"),
        (["--port", "70000"], "0-65535"),
    ],
)
def test_bad_combinations_fail_at_start(argv: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        cli.plan(argv)


def test_access_log_filter_drops_only_listed_paths() -> None:
    keep = _ExcludePaths(["/health"])

    def record(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:1", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    assert not keep.filter(record("/health")) and not keep.filter(record("/health?x=1"))
    assert keep.filter(record("/v1/models"))


def test_request_log_is_bounded_by_max_log_len(caplog: pytest.LogCaptureFixture) -> None:
    state = ServerState(engine=None, served_model_names=["m"], log_requests=True, max_log_len=5)
    with caplog.at_level(logging.INFO, logger="nxdserve.requests"):
        state.log_request("r1", ["abcdefghij", list(range(10))], "params")
    assert "'abcde'" in caplog.text and "abcdef" not in caplog.text and "[0, 1, 2, 3, 4]" in caplog.text


@pytest.mark.parametrize("disabled", [False, True])
def test_disable_log_stats_silences_the_throughput_line(disabled: bool, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from nxdserve import AsyncEngine, EngineConfig

    engine = AsyncEngine(EngineConfig(disable_log_stats=disabled))
    engine._last_log -= 3600  # the log interval has passed
    core = SimpleNamespace(prompt_tokens_total=10, generation_tokens_total=5, kv_cache_usage=0.5,
                           scheduler=SimpleNamespace(running=[1], waiting=[]))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="nxdserve.engine.async_engine"):
        engine._maybe_log(core)  # type: ignore[arg-type]
    assert ("Avg prompt throughput" in caplog.text) is not disabled


def test_nxd_only_settings_say_so_on_the_torch_backend(caplog: pytest.LogCaptureFixture) -> None:
    from nxdserve.config import EngineConfig
    from nxdserve.engine.backends import _note_nxd_only_settings

    with caplog.at_level(logging.INFO, logger="nxdserve.engine.backends"):
        _note_nxd_only_settings(EngineConfig(tensor_parallel_size=1))
        assert caplog.text == ""
        _note_nxd_only_settings(EngineConfig(tensor_parallel_size=2, override_neuron_config={"bogus_key": 1}))
    assert "--tensor-parallel-size 2" in caplog.text and "--override-neuron-config ['bogus_key']" in caplog.text
