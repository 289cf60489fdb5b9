"""Data parallel without a model: core and NeuronCore placement, the CLI flags, errors across the pipe, and
the engine-labelled /metrics exposition."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from nxdserve.cli import build_parser, engine_config_from_args
from nxdserve.engine.dp.args import apply_data_parallel_args
from nxdserve.engine.dp.metrics import labelled_registry
from nxdserve.engine.dp.placement import NEURON_CORES_ENV, parse_core_list, plan, split_evenly
from nxdserve.engine.dp.protocol import from_wire, to_wire
from nxdserve.errors import ConfigError, QueueFullError, RequestFailedError, RequestTooLongError


def test_cpu_cores_split_evenly_and_disjoint() -> None:
    assert split_evenly([0, 1, 2, 3, 4], 2) == [(0, 1, 2), (3, 4)]
    placements = plan(2, 1, "torch", cpus=[0, 1, 2, 3])
    assert [p.cpus for p in placements] == [(0, 1), (2, 3)]
    assert all(NEURON_CORES_ENV not in p.env for p in placements)  # the torch backend touches no NeuronCores
    with pytest.raises(ConfigError, match="needs at least 3 CPU cores"):
        plan(3, 1, "torch", cpus=[0, 1])


def test_neuron_cores_follow_the_tensor_parallel_degree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NEURON_CORES_ENV, raising=False)
    placements = plan(2, 2, "nxd", cpus=[0, 1, 2, 3])
    assert [p.env[NEURON_CORES_ENV] for p in placements] == ["0,1", "2,3"]
    # Inside an allocation the device plugin / scheduler made (NEURON_RT_VISIBLE_CORES=8-11): split that.
    monkeypatch.setenv(NEURON_CORES_ENV, "8-11")
    assert parse_core_list("8-11") == [8, 9, 10, 11] and parse_core_list("0,2, 5") == [0, 2, 5]
    assert [p.env[NEURON_CORES_ENV] for p in plan(2, 2, "nxd", cpus=[0, 1])] == ["8,9", "10,11"]
    with pytest.raises(ConfigError, match="needs 8 NeuronCores"):
        plan(2, 4, "nxd", cpus=[0, 1])


def _parse(*argv: str) -> object:
    args = build_parser().parse_args(list(argv))
    return apply_data_parallel_args(engine_config_from_args(args), args)


def test_cli_flags() -> None:
    assert _parse().data_parallel_size == 1  # type: ignore[attr-defined]
    assert _parse("--data-parallel-size", "2").data_parallel_size == 2  # type: ignore[attr-defined]
    assert _parse("-dp", "2", "--data-parallel-size-local", "2").data_parallel_size == 2  # type: ignore[attr-defined]
    for argv, message in [
        (("-dp", "2", "--data-parallel-size-local", "1"), "must equal --data-parallel-size"),
        (("-dp", "2", "--data-parallel-address", "10.0.0.1"), "--data-parallel-address is not supported"),
        (("-dp", "2", "--data-parallel-backend", "ray"), "ray_serve"),
        (("--data-parallel-size", "0"), "at least 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _parse(*argv)


def test_errors_keep_their_type_and_param_across_the_pipe() -> None:
    rebuilt = from_wire(to_wire(RequestTooLongError("too long", param="max_tokens")))
    assert isinstance(rebuilt, RequestTooLongError) and rebuilt.param == "max_tokens"
    assert isinstance(from_wire(to_wire(QueueFullError("full"))), QueueFullError)
    other = from_wire(to_wire(KeyError("boom")))
    assert isinstance(other, RequestFailedError) and "KeyError" in str(other)


def _engine_exposition(running: int, generated: int) -> str:
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry).labels("m").set(running)
    Counter("vllm:generation_tokens", "tokens", ["model_name"], registry=registry).labels("m").inc(generated)
    return generate_latest(registry).decode()


def test_metrics_of_every_engine_in_one_exposition() -> None:
    texts = {"0": _engine_exposition(3, 10), "1": _engine_exposition(1, 7)}
    text = generate_latest(labelled_registry(lambda: texts, "engine")).decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 1.0' in text
    assert 'vllm:generation_tokens_total{engine="1",model_name="m"} 7.0' in text
    assert text.count("# TYPE vllm:generation_tokens_total counter") == 1  # one family, a series per engine


def test_lora_with_data_parallel_is_refused_at_start_up() -> None:
    from nxdserve.cli import plan as plan_command_line

    with pytest.raises(ConfigError, match="--enable-lora with --data-parallel-size"):
        plan_command_line(["--data-parallel-size", "2", "--enable-lora", "--lora-modules", "a=/tmp/a"])
