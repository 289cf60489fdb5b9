"""The `nxdserve` command line: flags, aliases, subcommands, and a real process drained by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest

from nxdserve import cli
from nxdserve.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> cli.argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def test_flags_map_to_engine_config() -> None:
    args = parse(
        "--model", "/m", "--served-model-name", "a", "b", "--max-model-len", "1k", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256", "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "64",
        "--enable-prefix-caching",
        "--max-num-partial-prefills", "2", "--max-consecutive-prefill-steps", "3", "--max-waiting", "10",
        "--backend", "torch", "--dtype", "bfloat16", "--device", "cpu", "--num-threads", "2", "--seed", "7",
        "--max-logprobs", "5", "--generation-config", "vllm", "--tensor-parallel-size", "2",
        "--override-neuron-config", '{"a": 1}',
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
    )  # fmt: skip
    cfg = cli.engine_config_from_args(args)
    assert cfg.model == "/m" and cfg.served_model_name == ["a", "b"]
    assert cfg.max_model_len == 1000 and cfg.max_num_seqs == 4 and cfg.max_num_batched_tokens == 256
    assert cfg.enable_chunked_prefill is False and cfg.scheduling_mode == "prefill-first"
    assert cfg.enable_prefix_caching is True
    assert (cfg.long_prefill_token_threshold, cfg.max_num_partial_prefills) == (64, 2)
    assert (cfg.max_consecutive_prefill_steps, cfg.max_waiting) == (3, 10)
    assert (cfg.backend, cfg.dtype, cfg.device, cfg.num_threads, cfg.seed) == ("torch", "bfloat16", "cpu", 2, 7)
    assert (cfg.max_logprobs, cfg.generation_config, cfg.tensor_parallel_size) == (5, "vllm", 2)
    assert cfg.override_neuron_config == {"a": 1}
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def test_defaults_match_vllm_serve() -> None:
    args = parse()
    cfg = cli.engine_config_from_args(args)
    assert cfg.model is None and cfg.enable_chunked_prefill and cfg.max_logprobs == 20
    assert cfg.enable_prefix_caching is False  # unlike vLLM: opt in (see README, Scheduling)
    opts = cli.serve_options_from_args(args)
    assert (opts.port, opts.api_key, opts.log_requests) == (8000, None, True)


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.serve_options_from_args(parse()).api_key == "from-env"
    assert cli.serve_options_from_args(parse("--api-key", "flag")).api_key == "flag"


@pytest.mark.parametrize(
    "spec",
    [
        '{"method": "ngram"}',
        '{"method": "medusa", "num_speculative_tokens": 2}',
        '{"method": "eagle", "num_speculative_tokens": 2}',
        '{"num_speculative_tokens": 0}',
        "[1, 2]",
        "{not json",
    ],
)
def test_bad_speculative_config_fails_at_startup(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--speculative-config", spec])
    assert info.value.code == 2
    assert "speculative-config" in capsys.readouterr().err


def test_help_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--served-model-name", "--no-enable-chunked-prefill", "--speculative-config", "--api-key"):
        assert flag in out
    assert "nxdserve bench" in out


def test_subcommands_dispatch_lazily(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("fake_bench")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", ("fake_bench", "main"))
    assert cli.main(["bench", "--num-prompts", "3"]) == 0
    assert seen == [["--num-prompts", "3"]]
    monkeypatch.setitem(cli.SUBCOMMANDS, "train-eagle", ("nxdserve.no_such_module", "main"))
    assert cli.main(["train-eagle", "--x"]) == 2
    assert "not available" in capsys.readouterr().err


def test_bench_without_its_extra_names_the_pip_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As on an install without the `bench` extra: aiohttp cannot be imported, nor the modules that use it.
    for name in [m for m in sys.modules if m == "aiohttp" or m.startswith(("aiohttp.", "nxdserve.bench"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    assert cli.main(["bench", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "aiohttp" in err and "pip install 'nxdserve[bench]'" in err
    monkeypatch.setitem(cli.SUBCOMMANDS, "train-eagle", ("tests.api.needs_aiohttp", "main"))
    with pytest.raises(ModuleNotFoundError):  # a subcommand without an extra shows the import error itself
        cli.main(["train-eagle"])


def test_serve_alias_accepts_a_positional_model(monkeypatch: pytest.MonkeyPatch) -> None:
    captured: dict[str, object] = {}

    async def fake_serve(config: object, opts: object) -> int:
        captured.update(config=config, opts=opts)
        return 0

    monkeypatch.setattr("nxdserve.api.server.serve", fake_serve)
    assert cli.main(["serve", "/models/x", "--port", "9001"]) == 0
    assert captured["config"].model == "/models/x"  # type: ignore[attr-defined]
    assert captured["opts"].port == 9001  # type: ignore[attr-defined]


def test_the_model_may_come_after_the_flags() -> None:
    """vLLM's ``model_tag`` is an optional positional: ``vllm serve --port 8001 MODEL`` works, and so does
    ``nxdserve MODEL`` (the usage line's form)."""
    assert cli.plan(["--port", "9001", "/models/x"])[0].model == "/models/x"
    assert cli.plan(["/models/x", "--max-num-seqs", "4"])[0].model == "/models/x"
    assert cli.plan(["/models/x", "--model", "/models/x"])[0].model == "/models/x"
    with pytest.raises(ConfigError, match="given twice"):
        cli.plan(["--model", "/models/a", "/models/b"])
    with pytest.raises(SystemExit):
        cli.plan(["/models/a", "/models/b"])
    with pytest.raises(SystemExit):
        cli.plan(["--no-such-flag"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(*flags: str) -> tuple[subprocess.Popen[str], int, str]:
    """A real ``nxdserve`` process on a free port: (process, port, its log up to the ready line)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "nxdserve.cli", "--host", "127.0.0.1", "--port", str(port), "--backend", "torch",
           "--dtype", "float32", "--max-model-len", "256", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "server exited:\n" + "".join(lines)
        lines.append(line)
        if line.startswith("nxdserve ready:"):
            return proc, port, "".join(lines)
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines))


@pytest.mark.slow
def test_process_serves_then_drains_on_sigterm() -> None:
    proc, port, log = _start_server("--max-num-seqs", "4", "--drain-timeout", "60", "--served-model-name", "smol")
    try:
        assert f"http://127.0.0.1:{port}/v1" in log.splitlines()[-1]
        assert "effective configuration" in log and "backend=torch" in log
        body = {"model": "smol", "prompt": "Hello", "max_tokens": 12, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            raw = ""
            for piece in r.iter_text():
                if not raw:
                    proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still complete
                raw += piece
        frames = [f[len("data: ") :] for f in raw.split("\n\n") if f]
        assert frames[-1] == "[DONE]"
        assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_second_sigint_exits_without_running_the_queue() -> None:
    """The first Ctrl-C drains (up to --drain-timeout 300 here); the second aborts what is left and exits at once,
    rather than running every queued request to its end."""
    import threading

    proc, port, _ = _start_server("--max-num-seqs", "1", "--drain-timeout", "300")
    finishes: list[str | None] = []
    first_bytes = threading.Event()

    def stream() -> None:
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        reason = None
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    first_bytes.set()
                    if line.startswith("data: {"):
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
        except httpx.HTTPError:
            reason = "disconnected"
        finishes.append(reason)

    try:
        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        assert first_bytes.wait(120)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert proc.wait(timeout=60) == 0
        for t in threads:
            t.join(60)
        # 4 x 200 tokens one at a time would take far longer than the exit did
        assert time.monotonic() - start < 30
        assert finishes.count("length") < 4, finishes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_refusal_at_start_is_one_error_line_and_exit_2(tmp_path: Path) -> None:
    """A refusal raised while the engine starts (here a --lora-modules folder with no adapter) ends the process
    with the reason on one line, not a traceback."""
    cmd = [
        sys.executable, "-m", "nxdserve.cli", "--port", str(_free_port()), "--backend", "torch", "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "2", "--enable-lora", "--lora-modules", f"x={tmp_path}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no adapter_config.json" in done.stderr and "Traceback" not in done.stderr


def test_zero_lora_limits_reach_the_engine_checks() -> None:
    """``--max-loras 0`` / ``--max-lora-rank 0`` are values, not "unset": the engine refuses them at start."""
    cfg = cli.plan(["--model", "/m", "--enable-lora", "--max-loras", "0", "--max-lora-rank", "0"])[0]
    assert (cfg.max_loras, cfg.max_lora_rank) == (0, 0)
    defaults = cli.plan(["--model", "/m", "--enable-lora"])[0]
    assert (defaults.max_loras, defaults.max_lora_rank) == (1, 16)
