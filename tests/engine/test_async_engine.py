"""AsyncEngine: streaming, cancellation, abort, responsiveness, failures and clean shutdown."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator

import pytest

from nxdserve import AsyncEngine, EngineConfig, EngineDeadError, InvalidRequestError, SamplingParams
from nxdserve.sampling_params import OutputKind

pytestmark = pytest.mark.anyio


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(EngineConfig(dtype="float32", backend="torch", max_model_len=256, max_num_seqs=4)) as eng:
        yield eng


def _greedy(max_tokens: int, kind: OutputKind = OutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def _pin_handoff(engine: AsyncEngine, overlap: bool) -> None:
    """Pin how the loop hands a step's outputs over, whatever this machine's cores: with ``overlap`` they are
    made and delivered while the next forward computes; without, before the next step is launched (what the
    loop does when a CPU forward's threads fill every core)."""
    core = engine.core
    assert core is not None
    core.backend.forward_fills_host_cpus = lambda: not overlap  # type: ignore[method-assign]


def _trace_schedule_and_deliver(engine: AsyncEngine) -> list[str]:
    """Record "schedule" for each non-empty step scheduled and "deliver" for each step's outputs delivered, in
    order, into the returned list."""
    core = engine.core
    assert core is not None
    events: list[str] = []
    schedule, deliver = core.schedule, engine._deliver

    def traced_schedule() -> object:
        sched = schedule()
        if not sched.is_empty:
            events.append("schedule")
        return sched

    def traced_deliver(outputs: list) -> None:  # type: ignore[type-arg]
        events.append("deliver")
        deliver(outputs)

    core.schedule = traced_schedule  # type: ignore[method-assign]
    engine._deliver = traced_deliver  # type: ignore[method-assign]
    return events


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
async def test_stream_deltas_add_up_to_the_final_output(engine: AsyncEngine, overlap: bool) -> None:
    _pin_handoff(engine, overlap)
    text, tokens, finals = "", [], []
    async for out in engine.generate("The capital of France is", _greedy(12)):
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
        if out.finished:
            finals.append(out)
    [final_only] = [o async for o in engine.generate("The capital of France is", _greedy(12, OutputKind.FINAL_ONLY))]
    assert len(finals) == 1 and finals[0].outputs[0].finish_reason == "length"
    assert tokens == final_only.outputs[0].token_ids and text == final_only.outputs[0].text
    assert final_only.metrics.first_token_time is not None and final_only.metrics.finished_time is not None


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
async def test_breaking_out_of_the_iterator_aborts_and_frees_the_slot(engine: AsyncEngine, overlap: bool) -> None:
    _pin_handoff(engine, overlap)
    seen = 0
    async for _ in engine.generate("Tell me a long story.", _greedy(200)):
        seen += 1
        if seen == 2:
            break
    for _ in range(200):
        if engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


async def test_abort_is_idempotent_and_ends_the_stream(engine: AsyncEngine) -> None:
    stream = engine.add_request("Tell me a long story.", _greedy(200), request_id="r1")
    first = await stream.__anext__()
    assert not first.finished
    engine.abort("r1")
    engine.abort("r1")
    engine.abort("never-existed")
    rest = [o async for o in stream]  # a consumer still listening gets one final "abort" output
    assert len(rest) == 1 and rest[0].finished and rest[0].outputs[0].finish_reason == "abort"
    for _ in range(200):
        if engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_running == 0
    # The id may be reused once it is gone.
    out = [o async for o in engine.generate("Hi", _greedy(2), request_id="r1")]
    assert out[-1].finished


async def test_aborting_an_n_request_by_its_own_id_ends_every_choice(engine: AsyncEngine) -> None:
    params = SamplingParams(n=2, temperature=0.0, max_tokens=64, ignore_eos=True, output_kind=OutputKind.DELTA)
    finish: dict[int, str | None] = {}
    tokens = 0
    async for out in engine.generate("Tell me a long story.", params, request_id="par"):
        tokens += sum(len(c.token_ids) for c in out.outputs)
        if tokens and not finish:
            engine.abort("par")
            engine.abort("par")  # idempotent
        for c in out.outputs:
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert finish == {0: "abort", 1: "abort"} and tokens < 2 * 64
    for _ in range(200):
        if engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
    out = [o async for o in engine.generate("Hi", SamplingParams(n=2, max_tokens=2), request_id="par")]
    assert out[-1].finished  # the id is free again


async def test_an_id_names_one_request_or_choice_at_a_time(engine: AsyncEngine) -> None:
    """An n > 1 request's id and its choices' ids (``x-0``, ...) are taken while it runs: another request under
    one of them would be aborted with it."""
    params = SamplingParams(n=2, temperature=0.0, max_tokens=64, ignore_eos=True, output_kind=OutputKind.DELTA)
    running = engine.generate("Tell me a long story.", params, request_id="x")
    await running.__anext__()
    for request_id, n in [("x", 1), ("x", 2), ("x-0", 2), ("x-1", 1)]:
        with pytest.raises(InvalidRequestError, match="already in flight"):
            if n == 1:
                engine.add_request("Hi", _greedy(2), request_id=request_id)
            else:
                await engine.generate("Hi", SamplingParams(n=n, max_tokens=2), request_id=request_id).__anext__()
    engine.abort("x")
    assert [o async for o in running][-1].finished


async def test_event_loop_stays_responsive_during_generation(engine: AsyncEngine) -> None:
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    outputs = [o async for o in engine.generate("Write a poem about the sea.", _greedy(24))]
    stop.set()
    await task
    # The forward runs in a worker thread, so the ticker runs while each step computes.
    assert ticks >= len(outputs)


async def test_bad_request_raises_typed_error_and_others_continue(engine: AsyncEngine) -> None:
    good = asyncio.create_task(_collect(engine.generate("Hello there", _greedy(8))))
    with pytest.raises(InvalidRequestError):
        engine.add_request("", _greedy(4))
    with pytest.raises(InvalidRequestError):
        engine.add_request([engine.vocab_size], _greedy(4))
    for field, value in [("temperature", "0.5"), ("max_tokens", 4.0), ("seed", "7"), ("n", True)]:
        bad = SamplingParams(max_tokens=4)
        setattr(bad, field, value)
        with pytest.raises(InvalidRequestError, match=field) as info:  # typed, naming it: not a TypeError
            engine.add_request("Hi", bad)
        assert info.value.param == field
    outs = await good
    assert outs[-1].outputs[0].finish_reason == "length"


async def _collect(gen: AsyncIterator[object]) -> list:  # type: ignore[type-arg]
    return [o async for o in gen]


def _sampled(n: int, kind: OutputKind, seed: int = 5) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True, output_kind=kind)


async def test_n_choices_fold_into_the_parent_output_in_every_kind(engine: AsyncEngine) -> None:
    """n > 1 on the embedded engine: one output stream whose CompletionOutputs carry their choice's index, each
    choice the sequence a single request seeded seed + i gives (vLLM's rule)."""
    singles = [(await _collect(engine.generate("Once upon a time", _sampled(1, OutputKind.FINAL_ONLY, 5 + i))))
               [-1].outputs[0].token_ids for i in range(3)]  # fmt: skip
    assert len({tuple(t) for t in singles}) > 1  # the seeds differ, so the choices can be told apart
    [final] = await _collect(engine.generate("Once upon a time", _sampled(3, OutputKind.FINAL_ONLY), request_id="p"))
    assert final.finished and final.request_id == "p"
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.token_ids for c in final.outputs] == singles
    deltas = await _collect(engine.generate("Once upon a time", _sampled(3, OutputKind.DELTA)))
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    joined: dict[int, list[int]] = {}
    for out in deltas:
        (choice,) = out.outputs
        joined.setdefault(choice.index, []).extend(choice.token_ids)
    assert [joined[i] for i in range(3)] == singles
    cumulative = await _collect(engine.generate("Once upon a time", _sampled(3, OutputKind.CUMULATIVE)))
    assert [c.token_ids for c in cumulative[-1].outputs] == singles and cumulative[-1].finished
    assert engine.stats().num_running == 0


async def test_n_is_bounded_and_a_single_request_refuses_it(engine: AsyncEngine) -> None:
    for n in (0, 257):
        with pytest.raises(InvalidRequestError, match="n must be"):
            await _collect(engine.generate("Hi", _sampled(n, OutputKind.FINAL_ONLY)))
    with pytest.raises(InvalidRequestError, match="one sequence"):
        engine.add_request("Hi", _sampled(2, OutputKind.FINAL_ONLY))


async def test_breaking_out_of_n_choices_frees_every_slot(engine: AsyncEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=200, ignore_eos=True)
    async for _ in engine.generate("Tell me a long story.", params):
        break
    for _ in range(200):
        if engine.stats().num_running == 0 and engine.stats().num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


async def test_min_tokens_beyond_the_room_left_is_a_typed_error(engine: AsyncEngine) -> None:
    """With max_tokens unset the room left in the context is the limit; min_tokens above it (even one no int64
    holds) is refused before it reaches the batch, where it would fail the whole step."""
    for min_tokens in (10**6, 2**70):
        with pytest.raises(InvalidRequestError, match="min_tokens"):
            engine.add_request("Hi", SamplingParams(min_tokens=min_tokens))


async def test_backend_failure_finishes_requests_with_error_then_engine_dies() -> None:
    eng = AsyncEngine(EngineConfig(dtype="float32", backend="torch", max_model_len=128, max_num_seqs=2))
    await eng.start()
    try:
        core = eng.core
        assert core is not None

        def broken(plan: object) -> object:
            raise RuntimeError("device fell over")

        core.backend.execute = broken  # type: ignore[method-assign]
        outs = [o async for o in eng.generate("Hello", _greedy(4))]
        assert outs[-1].outputs[0].finish_reason == "error" and "device fell over" in (outs[-1].error or "")
        assert eng.is_healthy  # one failed step does not kill the engine
        for _ in range(2):  # the third consecutive failed step marks the engine dead
            [o async for o in eng.generate("Hello", _greedy(4))]
        for _ in range(100):
            if not eng.is_healthy:
                break
            await asyncio.sleep(0.01)
        assert not eng.is_healthy
        with pytest.raises(EngineDeadError):
            eng.add_request("Hello", _greedy(4))
    finally:
        await eng.shutdown()


async def test_next_forward_starts_before_the_previous_steps_outputs_are_delivered(engine: AsyncEngine) -> None:
    """Handlers' streaming work for step n runs during step n + 1's forward, not between forwards: the loop
    schedules and submits step n + 1 (both on the event loop's thread) before it delivers step n."""
    _pin_handoff(engine, overlap=True)
    events = _trace_schedule_and_deliver(engine)
    outs = [o async for o in engine.generate("Count to ten:", _greedy(6))]
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6
    # One prefill step and five decode steps: each delivery but the last follows the next step's schedule.
    assert events == ["schedule"] + ["schedule", "deliver"] * 5 + ["deliver"]


async def test_step_outputs_wait_until_the_next_forward_has_set_up(engine: AsyncEngine) -> None:
    """The loop holds its output processing back until the worker thread has set up step n + 1 and entered
    the model (``Backend.forward_started``), so that the two threads do not take turns on the GIL; so every
    output but the last is delivered after the next forward started."""
    _pin_handoff(engine, overlap=True)
    core = engine.core
    assert core is not None and core.backend.reports_forward_start
    starts: list[float] = []
    notify = core.backend.forward_started
    assert notify is not None

    def recording() -> None:  # in the worker thread, before the engine hears of it
        starts.append(time.monotonic())
        notify()

    core.backend.forward_started = recording
    seen: list[tuple[int, int]] = []  # (tokens so far, forwards started) as each output arrives
    async for out in engine.generate("Count to ten:", _greedy(6)):
        seen.append((out.outputs[0].cumulative_num_tokens, len(starts)))
    assert seen[-1][0] == 6
    for num_tokens, num_started in seen[:-1]:  # token k comes from forward k; forward k + 1 had begun
        assert num_started >= num_tokens + 1, seen


async def test_serial_handoff_sends_each_step_before_the_next_is_scheduled(engine: AsyncEngine) -> None:
    """When the forward's threads fill every core, the loop's per-token work (outputs, the consumer's frames
    and socket writes) runs between forwards instead of preempting one: step n's output reaches its consumer
    before step n + 1 is scheduled, and no step wakes the loop when its forward starts (nobody waits)."""
    _pin_handoff(engine, overlap=False)
    events = _trace_schedule_and_deliver(engine)
    wakes = 0

    def counted_wake(waiter: asyncio.Future[None]) -> None:
        nonlocal wakes
        wakes += 1

    engine._mark_forward_started = counted_wake  # type: ignore[method-assign]
    tokens: list[int] = []
    async for out in engine.generate("Count to ten:", _greedy(6)):
        tokens += out.outputs[0].token_ids
        events.append("received")
    assert len(tokens) == 6
    assert events == ["schedule", "deliver", "received"] * 6, events
    assert wakes == 0


async def test_serial_handoff_matches_overlap_token_for_token(engine: AsyncEngine) -> None:
    """The handoff changes when outputs are made, never what they are: two concurrent streams, a stop string
    and a logprobs request give the same text, tokens and finish either way."""

    async def run() -> list[tuple[str, list[int], str | None]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, output_kind=OutputKind.DELTA),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["."], output_kind=OutputKind.DELTA),
        ]
        prompts = ["The capital of France is", "Write a poem about the sea"]
        streams = [_collect(engine.generate(p, sp)) for p, sp in zip(prompts, params, strict=True)]
        results = await asyncio.gather(*streams)
        return [
            ("".join(o.outputs[0].text for o in outs), [t for o in outs for t in o.outputs[0].token_ids],
             outs[-1].outputs[0].finish_reason)
            for outs in results
        ]

    _pin_handoff(engine, overlap=True)
    overlapped = await run()
    _pin_handoff(engine, overlap=False)
    serial = await run()
    assert serial == overlapped
    assert len(serial[0][1]) == 10 and serial[0][2] == "length"


async def test_the_forward_fills_the_host_cpus_only_on_every_thread() -> None:
    """The torch backend on CPU says its forward fills the host's CPUs when it runs as many threads as the
    process may use, not when the thread governor dropped it to one thread."""
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("needs two CPUs")
    config = EngineConfig(dtype="float32", backend="torch", max_model_len=64, max_num_seqs=1, num_threads=cpus)
    async with AsyncEngine(config) as eng:
        backend = eng.core.backend  # type: ignore[union-attr]
        governor = backend.thread_governor  # type: ignore[attr-defined]
        assert governor.active and backend.forward_fills_host_cpus()
        governor.threads = 1
        assert not backend.forward_fills_host_cpus()


async def test_shutdown_leaves_no_threads() -> None:
    def model_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("nxdserve-model")}

    before = model_threads()  # other tests' servers may still be running theirs
    eng = AsyncEngine(EngineConfig(dtype="float32", backend="torch", max_model_len=128, max_num_seqs=2))
    await eng.start()
    assert model_threads() - before
    stream = eng.add_request("Tell me a story", _greedy(100))
    await stream.__anext__()
    await eng.shutdown(drain_timeout=0.1)
    assert not model_threads() - before
    assert not eng.is_healthy


async def _phase_order(engine: AsyncEngine, params: SamplingParams, prompt: str) -> tuple[list[str], str]:
    """Run one request, recording the engine loop's calls to update(), schedule() and emit() in order."""
    core = engine.core
    assert core is not None
    calls: list[str] = []
    originals = {name: getattr(core, name) for name in ("update", "schedule", "emit")}

    def recording(name: str):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            calls.append(name)
            return originals[name](*args)

        return call

    for name in originals:
        setattr(core, name, recording(name))
    try:
        outs = [o async for o in engine.generate(prompt, params)]
    finally:
        for name, fn in originals.items():
            setattr(core, name, fn)
    return calls, "".join(o.outputs[0].text for o in outs)


async def test_the_next_step_is_scheduled_before_detokenizing_unless_a_stop_string_may_end(engine: AsyncEngine) -> None:
    _pin_handoff(engine, overlap=True)
    calls, text = await _phase_order(engine, _greedy(8), "The capital of France is")
    after_update = [calls[i + 1] for i, c in enumerate(calls[:-1]) if c == "update"]
    # Without stop strings, the next step is scheduled (and launched) before this step's outputs are made.
    assert calls.count("update") == calls.count("emit") == 8
    assert after_update == ["schedule"] * 7 + ["emit"], calls  # the last step has nothing after it
    # A stop string may end the request in any step's text: outputs first, then the next schedule, so a
    # finished request is never scheduled again, and the text ends where the stop string starts.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop], output_kind=OutputKind.DELTA)
    stop_calls, stop_text = await _phase_order(engine, params, "The capital of France is")
    stop_after_update = [stop_calls[i + 1] for i, c in enumerate(stop_calls[:-1]) if c == "update"]
    assert stop_after_update and set(stop_after_update) == {"emit"}, stop_calls
    assert stop_text == text[: text.index(stop)]
    assert engine.stats().num_running == 0


async def test_the_model_thread_is_bound_to_a_cpu_and_the_event_loop_is_not(engine: AsyncEngine) -> None:
    """The engine owns its model thread, so the torch backend binds it (and its OpenMP team) to CPUs while
    it runs on every CPU's thread; the caller's threads are never bound."""
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    loop = asyncio.get_running_loop()
    threads, model_cpus = await loop.run_in_executor(
        engine._executor, lambda: (torch.get_num_threads(), os.sched_getaffinity(0))
    )
    if 1 < threads <= len(cpus):
        assert model_cpus == {cpus[0]}
    else:
        assert model_cpus == set(cpus)
    await engine.shutdown()
    assert os.sched_getaffinity(0) == set(cpus)
