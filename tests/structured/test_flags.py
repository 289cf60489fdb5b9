"""vLLM's flags for chat templates, tool calling, reasoning and structured outputs, checked at startup."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdserve.cli import build_parser, engine_config_from_args
from nxdserve.errors import ConfigError
from nxdserve.tools import get_tool_parser
from nxdserve.tools.flags import read_chat_template


def _config(*argv: str):  # type: ignore[no-untyped-def]
    return engine_config_from_args(build_parser().parse_args(list(argv)))


def test_flags_reach_the_engine_config() -> None:
    config = _config("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                     "--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}',
                     "--chat-template-content-format", "openai")
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
    assert config.reasoning_parser == "qwen3" and config.chat_template_content_format == "openai"
    assert config.structured_outputs_config == {"backend": "guidance", "disable_any_whitespace": True}
    assert _config("--guided-decoding-backend", "auto").structured_outputs_config == {"backend": "auto"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--tool-call-parser", "nope"], "hermes"),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], "llguidance"),
    (["--guided-decoding-backend", "outlines"], "llguidance"),
    (["--structured-outputs-config", '{"colour": 1}'], "colour"),
])
def test_bad_flags_fail_at_startup(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


def test_chat_template_file_or_inline(tmp_path: Path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0].content }}")
    assert read_chat_template(str(file)) == "{{ messages[0].content }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ConfigError, match="neither"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_tool_parser_plugin_registers_a_parser(tmp_path: Path) -> None:
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from nxdserve.tools import ParsedCall, ParsedOutput, ToolParser, register_tool_parser\n\n"
        "@register_tool_parser('shout')\n"
        "class Shout(ToolParser):\n"
        "    def parse(self, text, final):\n"
        "        return ParsedOutput(None, [ParsedCall(text.strip('!'), '{}')]) if text.endswith('!') "
        "else ParsedOutput(text)\n"
    )
    config = _config("--tool-parser-plugin", str(plugin), "--enable-auto-tool-choice", "--tool-call-parser", "shout")
    assert config.tool_call_parser == "shout"
    assert get_tool_parser("shout").parse("ping!", final=True).calls[0].name == "ping"
