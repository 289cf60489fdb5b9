"""benchmarks/compare.py --rounds: medians over interleaved rounds, ratios taken round by round."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load_compare() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
    spec = importlib.util.spec_from_file_location("compare_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


compare = _load_compare()


def test_aggregate_takes_each_metrics_median_and_keeps_the_rounds() -> None:
    rounds = [
        {"output_throughput": 600.0, "mean_ttft_ms": 500.0, "completed": 64, "note": "x"},
        {"output_throughput": 680.0, "mean_ttft_ms": 450.0, "completed": 64, "note": "y"},
        {"output_throughput": 650.0, "mean_ttft_ms": 470.0, "completed": 64, "note": "z"},
    ]
    agg = compare.aggregate_rounds(rounds)
    assert agg["output_throughput"] == 650.0
    assert agg["mean_ttft_ms"] == 470.0
    assert agg["completed"] == 64
    assert agg["note"] == "x"  # not a number: the first round's
    assert agg["rounds"] == rounds


def test_a_failed_round_fails_the_result() -> None:
    agg = compare.aggregate_rounds([{"output_throughput": 1.0}, {"error": "boom"}])
    assert agg["error"] == "round 2 of 2: boom"
    assert "output_throughput" not in agg


def test_ratios_pair_rounds_not_medians() -> None:
    # Drift: the machine slows in round 2 for both servers; per-round ratios stay 1.5x while the
    # ratio of medians of a 2-round result would mix the rounds.
    ours = compare.aggregate_rounds([{"output_throughput": 660.0}, {"output_throughput": 600.0}])
    peer = compare.aggregate_rounds([{"output_throughput": 440.0}, {"output_throughput": 400.0}])
    assert compare.round_ratios(ours, peer, "output_throughput") == pytest.approx([1.5, 1.5])
    lopsided = compare.aggregate_rounds([{"output_throughput": 660.0}, {"output_throughput": 500.0}])
    assert compare.round_ratios(lopsided, peer, "output_throughput") == pytest.approx([1.5, 1.25])
    assert compare.round_ratios(ours, {"output_throughput": 440.0}, "output_throughput") == []


def test_table_shows_the_median_ratio_and_its_range() -> None:
    ours = compare.aggregate_rounds(
        [{"output_throughput": t, "mean_ttft_ms": 400.0, "p99_itl_ms": 100.0} for t in (660.0, 600.0, 700.0)]
    )
    peer = compare.aggregate_rounds(
        [{"output_throughput": t, "mean_ttft_ms": 1000.0, "p99_itl_ms": 100.0} for t in (440.0, 400.0, 400.0)]
    )
    args = argparse.Namespace(scale=1.0, smoke=False)
    table = compare.format_table({"a": {"nxdserve": ours, "vllm": peer}}, ["nxdserve", "vllm"], args)
    row = next(line for line in table.splitlines() if "output tok/s" in line)
    # per-round ratios 1.5, 1.5, 1.75: median 1.5, range 1.50-1.75; values are the medians 660 and 400
    assert "1.50x (1.50-1.75)" in row
    assert "660.0" in row and "400.0" in row
    ttft = next(line for line in table.splitlines() if "mean TTFT" in line)
    assert "0.40x (0.40-0.40)" in ttft


def test_single_run_results_keep_plain_ratios() -> None:
    args = argparse.Namespace(scale=1.0, smoke=False)
    results = {"a": {"nxdserve": {"output_throughput": 600.0}, "vllm": {"output_throughput": 400.0}}}
    table = compare.format_table(results, ["nxdserve", "vllm"], args)
    row = next(line for line in table.splitlines() if "output tok/s" in line)
    assert "1.50x" in row and "(" not in row


def test_interleaved_rounds_alternate_servers_and_draw_new_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    @contextlib.contextmanager
    def fake_server(spec, log_dir, startup_timeout_s):  # type: ignore[no-untyped-def]
        yield f"http://{spec.name}"

    calls: list[tuple[str, str, int]] = []

    def fake_run(self, url, tok, args):  # type: ignore[no-untyped-def]
        calls.append((self.key, url.removeprefix("http://"), args.seed))
        return {"output_throughput": 600.0 if "nxd" in url else 400.0}

    monkeypatch.setattr(compare, "running_server", fake_server)
    monkeypatch.setattr(compare, "wait_for_server", lambda url, timeout_s: None)
    monkeypatch.setattr(compare.Workload, "run", fake_run)
    specs = [compare.ServerSpec("nxd", lambda port: [], ["a"]), compare.ServerSpec("peer", lambda port: [], ["a"])]
    args = argparse.Namespace(rounds=3, seed=7, startup_timeout=1.0)
    results: dict = {"a": {}}
    compare.run_interleaved(specs, results, tokenizer=None, args=args, log_dir=Path("."))
    assert [(server, seed) for _, server, seed in calls] == [
        ("nxd", 7), ("peer", 7), ("peer", 1007), ("nxd", 1007), ("nxd", 2007), ("peer", 2007),
    ]
    assert args.seed == 7  # the caller's namespace is left alone
    assert results["a"]["nxd"]["output_throughput"] == 600.0
    assert len(results["a"]["peer"]["rounds"]) == 3
    assert compare.round_ratios(results["a"]["nxd"], results["a"]["peer"], "output_throughput") == [1.5] * 3


def test_reversed_start_order_starts_the_last_listed_server_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    started: list[str] = []

    @contextlib.contextmanager
    def fake_server(spec, log_dir, startup_timeout_s):  # type: ignore[no-untyped-def]
        started.append(spec.name)
        yield f"http://{spec.name}"

    monkeypatch.setattr(compare, "running_server", fake_server)
    monkeypatch.setattr(compare, "wait_for_server", lambda url, timeout_s: None)
    monkeypatch.setattr(compare.Workload, "run", lambda self, url, tok, args: {"output_throughput": 1.0})
    specs = [compare.ServerSpec(name, lambda port: [], ["a"]) for name in ("nxd", "pf", "peer")]
    for order, expected in (("listed", ["nxd", "pf", "peer"]), ("reversed", ["peer", "pf", "nxd"])):
        started.clear()
        args = argparse.Namespace(rounds=2, seed=0, startup_timeout=1.0, start_order=order)
        results: dict = {"a": {}}
        compare.run_interleaved(specs, results, tokenizer=None, args=args, log_dir=Path("."))
        assert started == expected
        assert sorted(results["a"]) == ["nxd", "peer", "pf"]  # every server still ran each round
    assert compare.build_parser().parse_args(["--start-order", "reversed"]).start_order == "reversed"


def test_rotate_starts_fresh_servers_each_round_each_first_in_turn(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import contextlib

    events: list[tuple[str, str]] = []
    fail = {("pf", 1)}  # pf fails to start in round 2 only
    round_no = {"r": -1}

    @contextlib.contextmanager
    def fake_server(spec, log_dir, startup_timeout_s):  # type: ignore[no-untyped-def]
        if (spec.name, round_no["r"]) in fail:
            raise compare.BenchError("port in use")
        events.append(("start", spec.name))
        try:
            yield f"http://{spec.name}-{round_no['r']}"
        finally:
            events.append(("stop", spec.name))

    urls_seen: list[str] = []

    def fake_run(self, url, tok, args):  # type: ignore[no-untyped-def]
        urls_seen.append(url.removeprefix("http://"))
        return {"output_throughput": 2.0}

    real_start = compare._start_servers

    def counting_start(stack, specs, results, args, log_dir):  # type: ignore[no-untyped-def]
        round_no["r"] += 1
        return real_start(stack, specs, results, args, log_dir)

    monkeypatch.setattr(compare, "running_server", fake_server)
    monkeypatch.setattr(compare, "_start_servers", counting_start)
    monkeypatch.setattr(compare, "wait_for_server", lambda url, timeout_s: None)
    monkeypatch.setattr(compare.Workload, "run", fake_run)
    specs = [compare.ServerSpec(name, lambda port: [], ["a"]) for name in ("nxd", "pf", "peer")]
    args = argparse.Namespace(rounds=3, seed=0, startup_timeout=1.0, start_order="rotate")
    results: dict = {"a": {}}
    compare.run_interleaved(specs, results, tokenizer=None, args=args, log_dir=tmp_path)
    assert sorted(d.name for d in tmp_path.iterdir()) == ["round-1", "round-2", "round-3"]  # logs kept per round
    starts = [name for kind, name in events if kind == "start"]
    # Round 1 starts nxd, pf, peer; round 2 pf (fails), peer, nxd; round 3 peer, nxd, pf.
    assert starts == ["nxd", "pf", "peer", "peer", "nxd", "peer", "nxd", "pf"]
    # Every round's servers are stopped before the next round's start.
    assert events[:6] == [("start", "nxd"), ("start", "pf"), ("start", "peer"),
                          ("stop", "peer"), ("stop", "pf"), ("stop", "nxd")]  # fmt: skip
    # Each round drives that round's servers (round 2 reverses the order and has no pf).
    assert urls_seen == ["nxd-0", "pf-0", "peer-0", "peer-1", "nxd-1", "nxd-2", "pf-2", "peer-2"]
    assert results["a"]["nxd"]["output_throughput"] == 2.0 and len(results["a"]["nxd"]["rounds"]) == 3
    assert results["a"]["pf"]["error"].startswith("round 2 of 3: server failed to start")
    assert compare.start_order(specs, "rotate", 4)[0].name == "pf"


def test_a_server_that_cannot_be_run_is_a_failed_start(tmp_path: Path) -> None:
    spec = compare.ServerSpec("ghost", lambda port: [str(tmp_path / "no-such-server"), str(port)], ["b"])
    with pytest.raises(compare.BenchError, match="cannot run"), compare.running_server(spec, tmp_path, 5.0):
        pass
    results: dict = {"b": {}}
    args = argparse.Namespace(startup_timeout=5.0)
    compare.run_sequential([spec], results, None, args, tmp_path)
    assert "cannot run" in results["b"]["ghost"]["error"]
