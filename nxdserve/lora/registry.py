"""The adapters an engine serves: every registered ``LoRARequest``, and the host copies of their weights,
at most ``max_cpu_loras`` of them, least recently used evicted first (an evicted adapter stays registered
and is read again from its path when a request needs it).

Loading reads files: the async engine calls ``load``/``resolve`` in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from nxdserve.engine.models.spec import ModelSpec
from nxdserve.errors import LoRAAdapterError, LoRANotFoundError
from nxdserve.lora.adapter import VALID_MAX_RANKS, LoraAdapter, load_peft_adapter
from nxdserve.lora.request import LoRARequest


def check_lora_limits(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> int:
    """Check --max-loras / --max-lora-rank / --max-cpu-loras; the number of host copies kept."""
    if max_loras < 1:
        raise LoRAAdapterError(f"max_loras must be >= 1, got {max_loras}", param="max_loras")
    if max_lora_rank not in VALID_MAX_RANKS:
        raise LoRAAdapterError(
            f"max_lora_rank {max_lora_rank} is not one of {list(VALID_MAX_RANKS)}", param="max_lora_rank"
        )
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if cpu < max_loras:
        raise LoRAAdapterError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})", param="max_cpu_loras")
    return cpu


class LoraRegistry:
    def __init__(
        self,
        spec: ModelSpec,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        check: Callable[[str, str], None] | None = None,
    ) -> None:
        """``check(name, path)``: the backend's own refusal (the nxd backend serves compiled-in adapters only)."""
        cpu = check_lora_limits(max_loras, max_lora_rank, max_cpu_loras)
        self.spec = spec
        self.check = check
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = cpu
        self.requests: dict[str, LoRARequest] = {}  # name -> what it was registered with, in order
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # host weights, least recent first
        self._lock = threading.Lock()  # loads run in worker threads

    def load(self, request: LoRARequest) -> LoraAdapter:
        """Register and load ``request``; a duplicate name or id, or an adapter that does not fit, raises."""
        with self._lock:
            if request.lora_name in self.requests:
                raise LoRAAdapterError(f"The lora adapter '{request.lora_name}' has already been loaded.",
                                       param="lora_name")
            if any(r.lora_int_id == request.lora_int_id for r in self.requests.values()):
                raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is already in use", param="lora_int_id")
        if self.check is not None:
            self.check(request.lora_name, request.lora_path)
        adapter = self._read(request)
        with self._lock:
            self.requests[request.lora_name] = request
            self._keep(adapter)
        return adapter

    def ensure(self, request: LoRARequest) -> LoraAdapter:
        """``request``'s adapter, registering it on first use (vLLM's generate(lora_request=...)); concurrent
        first uses of the same adapter register it once."""
        with self._lock:
            known = self.requests.get(request.lora_name)
        if known is None:
            try:
                return self.load(request)
            except LoRAAdapterError:
                with self._lock:
                    known = self.requests.get(request.lora_name)
                if known is None:
                    raise
        if known != request:
            raise LoRAAdapterError(
                f"The lora adapter '{request.lora_name}' is registered as {known}, not {request}", param="model"
            )
        return self.resolve(request.lora_name)

    def resolve(self, name: str) -> LoraAdapter:
        """The adapter's host weights, read again from its path if they were evicted."""
        with self._lock:
            request = self.requests.get(name)
            if request is None:
                raise LoRANotFoundError(f"The model `{name}` does not exist.")
            adapter = self._loaded.get(name)
            if adapter is not None:
                self._loaded.move_to_end(name)
                return adapter
        adapter = self._read(request)
        with self._lock:
            self._keep(adapter)
        return adapter

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def unload(self, name: str) -> LoRARequest:
        with self._lock:
            request = self.requests.pop(name, None)
            if request is None:
                raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
            self._loaded.pop(name, None)
            return request

    def _read(self, request: LoRARequest) -> LoraAdapter:
        return load_peft_adapter(
            request.lora_path, self.spec, self.max_lora_rank, request.lora_name, request.lora_int_id,
            request.base_model_name,
        )  # fmt: skip

    def _keep(self, adapter: LoraAdapter) -> None:
        self._loaded[adapter.name] = adapter
        self._loaded.move_to_end(adapter.name)
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)
