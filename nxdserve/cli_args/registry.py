"""Every serve flag with its class (implemented / no effect / refused / not yet), so the parser, the start-up
checks, ``--help`` and docs/flags.md come from one table."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from nxdserve.errors import ConfigError

logger = logging.getLogger("nxdserve.cli")

FlagKind = Literal["implemented", "no effect", "refused", "not yet"]
_HELP_TAG = {"implemented": "", "no effect": "[no effect] ", "refused": "[refused] ", "not yet": "[not yet] "}


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    dest: str
    kind: FlagKind
    group: str
    note: str
    default: Any
    # Values that pass silently although the kind would refuse or announce them (e.g. --kv-cache-dtype auto).
    allowed: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        return next(n for n in self.names if n.startswith("--"))

    def is_set(self, value: Any) -> bool:
        return value != self.default and value not in self.allowed


class ServeParser(argparse.ArgumentParser):
    """An ArgumentParser that remembers each serve flag's class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flags: list[Flag] = []

    def flag_group(self, title: str, description: str | None = None) -> FlagGroup:
        return FlagGroup(self, title, description)


@dataclass
class FlagGroup:
    parser: ServeParser
    title: str
    description: str | None = None
    _group: Any = field(init=False)

    def __post_init__(self) -> None:
        self._group = self.parser.add_argument_group(self.title, self.description)

    def add(
        self, *names: str, kind: FlagKind = "implemented", note: str = "", allowed: Iterable[Any] = (), **kwargs: Any
    ) -> None:
        """``note``: for implemented flags the help text; for the others, why (and what to do instead)."""
        help_text = kwargs.pop("help", None) or note
        action = self._group.add_argument(*names, help=f"{_HELP_TAG[kind]}{help_text}", **kwargs)
        self.parser.flags.append(Flag(names, action.dest, kind, self.title, note, action.default, tuple(allowed)))

    def no_effect(self, *names: str, note: str, **kwargs: Any) -> None:
        self.add(*names, kind="no effect", note=note, **kwargs)

    def refused(self, *names: str, note: str, **kwargs: Any) -> None:
        self.add(*names, kind="refused", note=note, **kwargs)

    def not_yet(self, *names: str, note: str, **kwargs: Any) -> None:
        self.add(*names, kind="not yet", note=note, **kwargs)


def check_flags(flags: Iterable[Flag], args: argparse.Namespace) -> list[str]:
    """Refuse what cannot work here (one ConfigError naming every such flag and what to do instead); return
    one info line per given flag that has no effect on this engine."""
    infos: list[str] = []
    problems: list[str] = []
    for flag in flags:
        value = getattr(args, flag.dest, flag.default)
        if flag.kind == "implemented" or not flag.is_set(value):
            continue
        if flag.kind == "no effect":
            infos.append(f"{flag.name} has no effect on this engine: {flag.note}")
        elif flag.kind == "not yet":
            problems.append(f"{flag.name}{_show(value)}: not available in nxdserve yet. {flag.note}")
        else:
            problems.append(f"{flag.name}{_show(value)} is not supported here: {flag.note}.")
    if problems:
        raise ConfigError("\n".join(problems))
    return infos


def _show(value: Any) -> str:
    return "" if value is True else f" {value!r}"


def log_infos(infos: Iterable[str]) -> None:
    for line in infos:
        logger.info("%s", line)


def flags_markdown(flags: Iterable[Flag]) -> str:
    """docs/flags.md: every flag, its class and why, grouped as the parser groups them."""
    lines = [
        "# `nxdserve` flags",
        "",
        "Generated from `nxdserve/cli_args` (`python -m nxdserve.cli_args > docs/flags.md`); a test keeps it in",
        "sync. Every `vllm serve` flag of vLLM 0.11+ is accepted, in one of these classes:",
        "",
        "- **implemented**: it does here what it does in vLLM (or the nxdserve equivalent the note names);",
        "- **no effect**: accepted; when given, the server logs one info line saying why it changes nothing here;",
        "- **refused**: a value other than the no-op default stops start-up with a message naming what to do;",
        "- **not yet**: a feature another open issue adds; until then a non-default value stops start-up saying so.",
        "",
        "Flags owned by other branches (structured outputs and tools: `--chat-template`, `--tool-call-parser`, ...;",
        "data parallelism: `--data-parallel-size`, ...; the CPU backend group) are listed by those branches.",
    ]
    group = None
    for flag in flags:
        if flag.group != group:
            group = flag.group
            lines += ["", f"## {group}", "", "| flag | class | notes |", "| --- | --- | --- |"]
        names = ", ".join(f"`{n}`" for n in flag.names)
        note = flag.note.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {names} | {flag.kind} | {note} |")
    return "\n".join(lines) + "\n"
