"""The backend contract: what the engine core asks of a model executor.

The data that crosses it (``StepPlan``, ``StepResult``, ``BackendCapabilities``, ...) lives in
nxdserve/engine/step.py, which no layer owns; it is re-exported here for backends' convenience.
A backend owns the engine's ``PersistentBatch``: it creates it in ``bind`` and is its only writer,
applying each plan's diffs at the start of ``execute`` and appending the step's sampled tokens at its
end, in the worker thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from nxdserve.engine.mm_inputs import MultiModalInputs
from nxdserve.engine.models.spec import ModelSpec
from nxdserve.engine.persistent_batch import PersistentBatch
from nxdserve.engine.step import (
    BackendCapabilities,
    FusedSpecResult,
    LogprobsBlock,
    NewRequest,
    StepPlan,
    StepResult,
)
from nxdserve.errors import ConfigError
from nxdserve.sampling_params import SamplingParams

__all__ = [
    "Backend",
    "BackendCapabilities",
    "FusedSpecResult",
    "LogprobsBlock",
    "NewRequest",
    "StepPlan",
    "StepResult",
]


class Backend(abc.ABC):
    """A model executor. ``execute`` runs in the engine's worker thread, never on the event loop."""

    name: str = "base"
    # Called by ``execute`` (in the worker thread) when its own Python is done and the model's compute, which
    # releases the GIL, begins; None: nobody listens. The async engine holds back its Python until then (where
    # the backend says it reports it), so that the two threads do not take turns on the GIL while the step is
    # being set up.
    forward_started: Callable[[], None] | None = None
    reports_forward_start: bool = False
    # The persistent batch this backend owns (None until ``bind``). Read it only in the worker thread.
    batch: PersistentBatch | None = None

    @property
    @abc.abstractmethod
    def capabilities(self) -> BackendCapabilities: ...

    def bind(self, max_num_seqs: int, max_model_len: int, max_spec_tokens: int) -> PersistentBatch:
        """Called once, before the first step, with the engine's sizes: create the persistent batch."""
        self.check_batch_size(max_num_seqs, max_model_len)
        self.batch = PersistentBatch(max_num_seqs, max_model_len, max_spec_tokens)
        return self.batch

    def check_batch_size(self, max_num_seqs: int, max_model_len: int) -> None:  # noqa: B027 - optional hook
        """Raise ConfigError when the engine's sizes exceed what the backend was built for."""

    def begin_step(self, plan: StepPlan) -> PersistentBatch:
        """The batch with ``plan``'s diffs applied: call first in ``execute``."""
        batch = self.batch
        if batch is None:
            raise RuntimeError(f"{type(self).__name__}.execute called before bind()")
        batch.apply(plan)
        return batch

    def end_step(self, plan: StepPlan, result: StepResult) -> StepResult:
        """Append the step's sampled tokens to the batch: call last in ``execute``."""
        assert self.batch is not None
        self.batch.append_sampled(plan.slots, result.sampled_token_ids, result.num_sampled)
        return result

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """One step: ``begin_step(plan)``, the forward and sampling, ``end_step(plan, result)``."""

    def lora_model_spec(self) -> ModelSpec:
        """The base model's shapes, which LoRA adapters are checked against; backends that run adapters
        override this (and read ``NewRequest.lora``)."""
        raise ConfigError(f"the {type(self).__name__} cannot run LoRA adapters")

    def check_lora(self, name: str, path: str) -> None:  # noqa: B027 - optional hook
        """Raise LoRAAdapterError for an adapter this backend cannot serve (checked when it is registered)."""

    def drop_lora(self, lora_int_id: int) -> None:  # noqa: B027 - optional hook
        """An adapter was unregistered: forget its device copy (rows still running on it keep it until they
        finish). Called in the worker thread."""

    def validate_request(self, params: SamplingParams) -> None:  # noqa: B027 - optional hook
        """Raise InvalidRequestError for parameters this backend cannot honour (checked at admission)."""

    def request_check(self) -> Callable[[SamplingParams], None] | None:
        """``validate_request`` as a picklable callable (a data-parallel front end runs it before a stream
        opens), or None where the backend checks nothing more than the engine does."""
        return None

    def validate_images(self, mm_inputs: MultiModalInputs) -> None:  # noqa: B027 - optional hook
        """Raise InvalidRequestError for a prompt's images this backend cannot run (checked at admission)."""

    def own_thread(self) -> None:  # noqa: B027 - optional hook
        """Called in the worker thread when the engine owns it (the async engine's model thread, which runs
        nothing else): the backend may bind it and its helpers to CPUs."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release device resources."""

    def forward_fills_host_cpus(self) -> bool:
        """Whether the next step's forward runs a thread on every CPU this process may use (a CPU forward on
        all intra-op threads). Then whatever the event loop does while a forward runs preempts one of its
        threads, and the others wait for it at the next barrier; a device backend computes elsewhere."""
        return False
