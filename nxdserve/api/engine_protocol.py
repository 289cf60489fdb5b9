"""What the API layer needs from an engine: exactly the attributes and methods nxdserve/api uses.

``AsyncEngine`` (one engine in this process) and ``DataParallelEngine`` (engine processes behind a
router) both satisfy it; mypy checks that with the assignments at the bottom.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: importing the engine here would load torch with the API
    from prometheus_client import CollectorRegistry

    from nxdserve.config import EngineConfig
    from nxdserve.engine.core import EngineStats
    from nxdserve.engine.outputs import RequestOutput
    from nxdserve.engine.prompts import PromptInput
    from nxdserve.lora.request import LoRARequest
    from nxdserve.sampling_params import SamplingParams


class EngineStream(Protocol):
    """One engine request's outputs; ``abort`` ends it early (a no-op once it has finished)."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


class EngineMetricsSource(Protocol):
    """The Prometheus side of an engine, as /metrics reads it."""

    @property
    def registry(self) -> CollectorRegistry: ...

    def record_step(self, num_running: int, num_waiting: int, kv_usage: float,
                    num_generated: int, num_scheduled: int) -> None: ...


class EngineClient(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Any: ...  # a transformers tokenizer (no usable common type)

    @property
    def model_path(self) -> str: ...

    @property
    def generation_defaults(self) -> dict[str, float | int]: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def backend_name(self) -> str: ...

    @property
    def metrics(self) -> EngineMetricsSource: ...

    async def start(self) -> None: ...

    async def shutdown(self, drain_timeout: float | None = None) -> None: ...

    def abort_all(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...

    async def prepare(self, params: SamplingParams) -> None: ...

    async def process_prompt(self, prompt: PromptInput, add_special_tokens: bool = True) -> PromptInput: ...

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> EngineStream: ...

    async def add_lora(self, lora_request: LoRARequest) -> None: ...

    async def remove_lora(self, lora_name: str) -> None: ...

    def list_loras(self) -> list[LoRARequest]: ...


if TYPE_CHECKING:  # both engines satisfy the protocol (checked by mypy, free at run time)
    from nxdserve.engine.async_engine import AsyncEngine
    from nxdserve.engine.dp.client import DataParallelEngine

    _async_engine: type[EngineClient] = AsyncEngine
    _data_parallel_engine: type[EngineClient] = DataParallelEngine
