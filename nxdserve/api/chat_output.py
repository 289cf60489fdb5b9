"""How a chat request's output becomes a message: tool_choice (none / auto / required / named), the tool-call
parser, the reasoning parser, and the structured-outputs constraint they imply.

``required`` and a named function are enforced by the grammar engine (the arguments always parse and match the
schema); ``auto`` lets the model write and the server's ``--tool-call-parser`` reads the calls out of its text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nxdserve.api.errors import APIError
from nxdserve.api.protocol import ChatCompletionRequest
from nxdserve.engine.structured import StructuredOutputsParams
from nxdserve.sampling_params import SamplingParams
from nxdserve.tools import ToolParser, get_tool_parser
from nxdserve.tools.parsers import NamedToolCallParser, RequiredToolCallsParser
from nxdserve.tools.reasoning import ReasoningParser, ReasoningStreamer, get_reasoning_parser
from nxdserve.tools.streaming import ToolCallStreamer, read_whole

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> function spec, checked."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str):
            raise APIError("Each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"Tool {fn['name']!r}: parameters must be a JSON schema object.", param="tools")
        out[fn["name"]] = fn
    return out


def _required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a list of {name, parameters} (and nothing else), $defs
    hoisted."""
    defs: dict[str, Any] = {}
    variants = []
    for name, fn in functions.items():
        params = dict(fn.get("parameters") or EMPTY_PARAMETERS)
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise APIError(f"Tool parameters define $defs {key!r} differently.", param="tools")
            defs[key] = value
        # No other keys: a model that wrote a "description" after the parameters ran on to max_tokens
        variants.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ChatOutputPlan:
    mode: str = "none"  # none | auto | required | named
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    parallel_tool_calls: bool = True
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def build(cls, req: ChatCompletionRequest, config: Any) -> ChatOutputPlan:
        functions = _functions(req.tools)
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if functions else "none"
        plan = cls(parallel_tool_calls=req.parallel_tool_calls is not False, functions=functions)
        if getattr(config, "reasoning_parser", None):
            plan.reasoning = get_reasoning_parser(config.reasoning_parser)
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
            if not isinstance(name, str):
                raise APIError('A named tool_choice is {"type": "function", "function": {"name": ...}}.',
                               param="tool_choice")
            if name not in functions:
                raise APIError(f"tool_choice names {name!r}, which is not in tools.", param="tool_choice")
            plan.mode, plan.tool_parser = "named", NamedToolCallParser(name)
        elif choice == "none" or (choice == "required" and not functions) or (choice == "auto" and not functions):
            plan.mode = "none"
        elif choice == "required":
            plan.mode, plan.tool_parser = "required", RequiredToolCallsParser()
        elif choice == "auto":
            if not getattr(config, "enable_auto_tool_choice", False) or not getattr(config, "tool_call_parser", None):
                raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
            plan.mode, plan.tool_parser = "auto", get_tool_parser(config.tool_call_parser)
        else:
            raise APIError(f"tool_choice must be none, auto, required or a named function; got {choice!r}.",
                           param="tool_choice")
        return plan

    def constrain(self, params: SamplingParams, prompt: str, tokenizer: Any, config: Any) -> None:
        """The grammar for required / named tool choice; server-wide structured-outputs defaults; a reasoning
        model's constraint starting after its thinking."""
        if self.mode in ("required", "named"):
            if params.structured_outputs is not None:
                raise APIError(f"tool_choice {self.mode!r} cannot be combined with {params.structured_outputs.param}.",
                               param="tool_choice")
            if self.mode == "named":
                assert isinstance(self.tool_parser, NamedToolCallParser)
                schema = self.functions[self.tool_parser.function_name].get("parameters") or EMPTY_PARAMETERS
            else:
                schema = _required_schema(self.functions, self.parallel_tool_calls)
            params.structured_outputs = StructuredOutputsParams(json=schema, param="tool_choice")
        elif self.mode == "auto" and self.tool_parser is not None and self.tool_parser.needs_special_tokens:
            params.skip_special_tokens = False  # the call markers may be special tokens (vLLM's adjust_request)
        apply_structured_defaults(params, config)
        spec = params.structured_outputs
        if spec is not None and self.reasoning is not None and not self.reasoning.prompt_ends_reasoning(prompt):
            enabled = ((getattr(config, "structured_outputs_config", None) or {}).get("enable_in_reasoning"))
            if not enabled:
                spec.start_after_token_ids = tuple(tokenizer.encode(self.reasoning.end, add_special_tokens=False))

    # -- reading the output --------------------------------------------------------------------------
    def message(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(content, reasoning_content, tool_calls) of a finished choice."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, final=True)
        if self.tool_parser is None:
            return content, reasoning, []
        # Read as a stream reads it, so that the streamed choice assembles to this one
        call_content, tool_calls = read_whole(self.tool_parser, content or "")
        tool_calls = tool_calls if self.parallel_tool_calls else tool_calls[:1]
        return (call_content or None) if tool_calls else content, reasoning, tool_calls

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """The choice's reason once it has finished (None on the chunks before its last)."""
        if called and self.mode in ("auto", "required") and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def streamer(self) -> ChoiceStreamer:
        return ChoiceStreamer(self)


@dataclass
class ChoiceStreamer:
    """One choice's stream: reasoning, content and tool-call deltas from its text deltas."""

    plan: ChatOutputPlan
    reasoning: ReasoningStreamer | None = None
    tools: ToolCallStreamer | None = None

    def __post_init__(self) -> None:
        if self.plan.reasoning is not None:
            self.reasoning = ReasoningStreamer(self.plan.reasoning)
        if self.plan.tool_parser is not None:
            self.tools = ToolCallStreamer(self.plan.tool_parser)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning delta, content delta, tool-call deltas)."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text, final)
        if self.tools is None:
            return reasoning, content, []
        out_content, deltas = self.tools.feed(content)
        if final:
            more_content, more = self.tools.finish()
            out_content += more_content
            deltas += more
        if not self.plan.parallel_tool_calls:
            deltas = [d for d in deltas if d["index"] == 0]
        return reasoning, out_content, deltas


def apply_structured_defaults(params: SamplingParams, config: Any) -> None:
    """--structured-outputs-config's whitespace and additionalProperties settings, for every constraint."""
    spec = params.structured_outputs
    settings = getattr(config, "structured_outputs_config", None) or {}
    if spec is None or not settings:
        return
    if settings.get("disable_any_whitespace"):
        spec.disable_any_whitespace = True
    if settings.get("disable_additional_properties"):
        spec.disable_additional_properties = True
