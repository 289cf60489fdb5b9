"""vLLM's ``--config FILE.yaml``: the file's keys are flag names, its values their values; flags given on the
command line win."""

from __future__ import annotations

from collections.abc import Container
from pathlib import Path
from typing import Any

from nxdserve.errors import ConfigError


def expand_config_file(argv: list[str], options: Container[str]) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the flags the file holds (placed first, so the command
    line overrides them). ``options``: the parser's option strings (which flags have a ``--no-`` form)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
        elif arg.startswith("--config="):
            path, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
        else:
            continue
        return _flags_from_yaml(Path(path), options) + rest
    return argv


def _flags_from_yaml(path: Path, options: Container[str]) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must be a YAML mapping of flag names to values")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        out += _flag_values(flag, value, options)
    return out


def _flag_values(flag: str, value: Any, options: Container[str]) -> list[str]:
    import json

    if value is True:
        return [flag]
    if value is False:  # its --no- form where it has one; else (a plain switch) false is its default
        negative = f"--no-{flag[2:]}"
        return [negative] if negative in options else []
    if isinstance(value, list):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
