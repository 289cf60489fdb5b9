"""Tool calling: parsers of each model family's tool-call text (hermes, llama3_json, mistral, pythonic), the
streamer that turns a growing text into OpenAI's tool-call deltas, and reasoning parsers. Importing this package
is light (no torch): the CLI's flags live here too."""

from nxdserve.tools.base import ParsedCall, ParsedOutput, ToolParser, get_tool_parser, register_tool_parser

__all__ = ["ParsedCall", "ParsedOutput", "ToolParser", "get_tool_parser", "register_tool_parser"]
