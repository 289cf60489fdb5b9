"""The prompt forms ``AsyncEngine.generate`` takes, as vLLM's ``LLM.generate`` does.

A prompt is a string, a list of token ids, or a dict: ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``,
either with ``"multi_modal_data": {"image": image_or_list}`` (PIL images). Every key is read or refused:
a dict field this engine cannot honour is an InvalidRequestError naming it, never silently dropped.
A ``ProcessedPrompt`` is a prompt whose images the model's processor has already turned into inputs
(``AsyncEngine.process_prompt``, off the event loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nxdserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from nxdserve.engine.mm_inputs import MultiModalInputs


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt with images, after the processor: expanded token ids and the images' inputs."""

    token_ids: list[int]
    mm_inputs: MultiModalInputs
    text: str | None = None  # the prompt text it came from, if any (reported back in outputs)


PromptInput = str | list[int] | Mapping[str, Any] | ProcessedPrompt
_DICT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data"})


@dataclass(frozen=True)
class ParsedPrompt:
    text: str | None
    token_ids: list[int] | None  # None: tokenize ``text``
    images: list[Any] = field(default_factory=list)  # PIL images, in prompt order
    mm_inputs: MultiModalInputs | None = None  # set when the images are processed already (then ``images`` is empty)


def parse_prompt(prompt: PromptInput) -> ParsedPrompt:
    if isinstance(prompt, ProcessedPrompt):
        return ParsedPrompt(prompt.text, list(prompt.token_ids), mm_inputs=prompt.mm_inputs)
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt)
    if isinstance(prompt, Sequence):
        return ParsedPrompt(None, _token_ids(prompt, "prompt"))
    raise InvalidRequestError(
        f"A prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}.", param="prompt"
    )


def _parse_dict(prompt: Mapping[str, Any]) -> ParsedPrompt:
    unknown = sorted(set(prompt) - _DICT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"Unsupported prompt field(s) {unknown}; a dict prompt takes {sorted(_DICT_KEYS)}.", param=unknown[0]
        )
    has_text, has_ids = "prompt" in prompt, "prompt_token_ids" in prompt
    if has_text == has_ids:
        raise InvalidRequestError("A dict prompt needs exactly one of 'prompt' and 'prompt_token_ids'.", param="prompt")
    if has_text and not isinstance(prompt["prompt"], str):
        raise InvalidRequestError("'prompt' must be a string.", param="prompt")
    images = _images(prompt.get("multi_modal_data"))
    if has_text:
        return ParsedPrompt(prompt["prompt"], None, images)
    return ParsedPrompt(None, _token_ids(prompt["prompt_token_ids"], "prompt_token_ids"), images)


def _token_ids(value: Any, param: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidRequestError(f"'{param}' must be a list of token ids.", param=param)
    return list(value)  # the ids themselves are checked at admission (EngineCore.make_request)


def _images(data: Any) -> list[Any]:
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise InvalidRequestError(
            "'multi_modal_data' must be a dict such as {'image': image}.", param="multi_modal_data"
        )
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise InvalidRequestError(
            f"multi_modal_data: modality {unknown[0]!r} is not supported; nxdserve takes images only.",
            param=f"multi_modal_data.{unknown[0]}",
        )
    from PIL import Image

    value = data.get("image")
    images = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(
                f"multi_modal_data.image[{i}] is a {type(image).__name__}, not a PIL image.",
                param=f"multi_modal_data.image[{i}]",
            )
    return images
