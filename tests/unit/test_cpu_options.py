"""CpuOptions: validation, the "CPU backend" CLI flags, and the OpenMP wait policy set by the CLI, not by import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nxdserve.cli import build_parser, engine_config_from_args
from nxdserve.config import EngineConfig
from nxdserve.cpu_options import CpuOptions, set_openmp_wait_policy
from nxdserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="must be one of"):
        CpuOptions(isa="sse9")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="amx=False"):
        CpuOptions(isa="amx", amx=False)
    with pytest.raises(ConfigError, match="gemm must be a bool"):
        CpuOptions(gemm="no")  # type: ignore[arg-type]
    assert EngineConfig().cpu == CpuOptions()


def test_cli_flags_become_the_config_cpu_options() -> None:
    parser = build_parser()
    args = parser.parse_args(["--cpu-isa", "generic", "--no-cpu-gemm", "--no-cpu-bind-threads", "--no-cpu-amx"])
    assert engine_config_from_args(args).cpu == CpuOptions(isa="generic", gemm=False, bind_threads=False, amx=False)
    assert engine_config_from_args(parser.parse_args([])).cpu == CpuOptions()
    switches = [a for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--no-cpu-")]
    assert len(switches) == 11 and all(a.default is True for a in switches)  # on unless switched off
    help_text = parser.format_help()
    assert "CPU backend" in help_text and "--cpu-isa" in help_text and "--no-cpu-kv-huge-pages" in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-isa", "sse9"])


def test_importing_nxdserve_sets_nothing_in_the_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT)
    code = "import os, nxdserve; from nxdserve import EngineConfig, SamplingParams; print(os.getenv('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"


def test_the_wait_policy_is_set_unless_the_user_chose_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    set_openmp_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    set_openmp_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ


def test_cpu_options_off_the_cpu_are_named_as_unused() -> None:
    from nxdserve.engine.loader import unused_cpu_switches

    changed = EngineConfig(cpu=CpuOptions(isa="generic", fused_quant_decode=False, quant_dense_rows=4))
    assert unused_cpu_switches(changed, on_cpu=True) == []
    assert unused_cpu_switches(changed, on_cpu=False) == ["isa", "fused_quant_decode", "quant_dense_rows"]
    assert unused_cpu_switches(EngineConfig(), on_cpu=False) == []
