"""The CLI flags of chat templates, tool calling, reasoning and structured outputs (vLLM's names), in one group
that ``nxdserve.cli`` adds, and their checks at startup."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from nxdserve.errors import ConfigError, InvalidRequestError

GRAMMAR_BACKENDS = frozenset({"auto", "guidance", "llguidance"})  # what nxdserve runs: llguidance
STRUCTURED_OUTPUTS_KEYS = frozenset({"backend", "disable_any_whitespace", "disable_additional_properties",
                                     "enable_in_reasoning", "reasoning_parser", "disable_fallback"})


def _json_or_kv(text: str) -> dict[str, Any]:
    """``--structured-outputs-config '{"backend": "guidance"}'`` or ``backend=guidance``."""
    try:
        value = json.loads(text)
    except ValueError:
        key, sep, raw = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError("expected a JSON object or KEY=VALUE") from None
        value = {key: raw.lower() == "true" if raw.lower() in ("true", "false") else raw}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("chat, tools and structured outputs")
    g.add_argument("--chat-template", default=None, help="chat template: a Jinja file or inline Jinja text")
    g.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                   help="how message content reaches the template: string (text parts joined) or openai (parts)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from the output: hermes | llama3_json | mistral | pythonic")
    g.add_argument("--tool-parser-plugin", default=None, help="a Python file that registers more tool parsers")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="put <think>...</think> into reasoning_content")
    g.add_argument("--structured-outputs-config", type=_json_or_kv, default=None,
                   help='JSON, e.g. \'{"backend": "guidance", "disable_any_whitespace": true}\'')
    g.add_argument("--guided-decoding-backend", default=None, help="vLLM's older name of the grammar backend")


def chat_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from the flags above, checked (ConfigError names the flag)."""
    structured = dict(args.structured_outputs_config or {})
    if args.guided_decoding_backend is not None:
        structured.setdefault("backend", args.guided_decoding_backend)
    kwargs = {
        "chat_template": args.chat_template,
        "chat_template_content_format": args.chat_template_content_format,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
        "tool_parser_plugin": args.tool_parser_plugin,
        "reasoning_parser": args.reasoning_parser,
        "structured_outputs_config": structured or None,
    }
    check_chat_config(**kwargs)
    return kwargs


def check_chat_config(**kwargs: Any) -> None:
    from nxdserve.tools.base import tool_parser_names

    if kwargs.get("tool_parser_plugin"):
        load_tool_parser_plugin(kwargs["tool_parser_plugin"])
    parser = kwargs.get("tool_call_parser")
    if kwargs.get("enable_auto_tool_choice") and not parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
    if parser is not None and parser not in tool_parser_names():
        raise ConfigError(f"--tool-call-parser {parser!r} is unknown; known: {', '.join(tool_parser_names())}")
    structured = kwargs.get("structured_outputs_config") or {}
    unknown = set(structured) - STRUCTURED_OUTPUTS_KEYS
    if unknown:
        raise ConfigError(f"--structured-outputs-config: unknown keys {sorted(unknown)}")
    backend = structured.get("backend", "auto")
    if backend not in GRAMMAR_BACKENDS:
        raise ConfigError(f"--structured-outputs-config backend {backend!r} is not available: nxdserve's grammar "
                          f"engine is llguidance ({', '.join(sorted(GRAMMAR_BACKENDS))})")


def load_tool_parser_plugin(path: str) -> None:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--tool-parser-plugin {path!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"nxdserve_tool_plugin_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def read_chat_template(value: str | None) -> str | None:
    """A file's text, or the value itself when it is inline Jinja (vLLM's rule: a path that exists is a file)."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def check_chat_template_flags(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """The one check of the chat template's two mutually exclusive switches (vLLM's wording)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
