"""The fused quantized forward (``fused_qdecode``, ``csrc/qdecode.c``) against the layer-by-layer path: the same
hidden states, logits and KV cache writes to fp32 rounding, on every runnable kernel path, and the same greedy
text from the engine with the switch on and off."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import cpu_build, cpu_kernels, cpu_weight_kernels, fused_qdecode, quant
from nxdserve.engine.models.attention import DraftAlternatives, SlotKVCache
from nxdserve.engine.models.llama import LlamaFamilyModel
from tests.helpers.cpu_paths import forced_cpu_path
from tests.helpers.tiny_model import single_torch_thread, slot_meta, tiny_model_path

KERNEL_PATHS = [p for p in cpu_build.runnable_paths() if p != "none"]
MAX_LEN = 48
PROMPT_LENS = (9, 20, 14, 31)  # slot i's prompt


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    with forced_cpu_path(request.param) as isa:
        yield isa


def _model(family: str, method: str) -> LlamaFamilyModel:
    model = LlamaFamilyModel.from_pretrained(tiny_model_path(family), torch.float32, torch.device("cpu"), MAX_LEN)
    if method == "bf16":  # --cpu-bf16-weights
        model.quantize_linears(lambda _name, weight: quant.store_bf16(weight))
    else:
        quant.quantize_model(model, method)
    return model


_meta = functools.partial(slot_meta, max_len=MAX_LEN)  # one step's AttentionMetadata in a MAX_LEN cache


def _prefilled(
    model: LlamaFamilyModel, gen: torch.Generator, storage: torch.dtype | None = None, calculate: bool = False
) -> SlotKVCache:
    """Four slots prefilled layer by layer (17+ tokens per forward: above quant.dense_rows, never fused).
    ``storage``, ``calculate``: an fp8 cache, with scales from the first prompt's K/V."""
    cache = model.new_kv_cache(len(PROMPT_LENS), MAX_LEN, storage, calculate)
    for slot, n in enumerate(PROMPT_LENS):
        prompt = torch.randint(0, model.vocab_size, (n,), generator=gen)
        with torch.inference_mode():
            model(prompt, _meta(model, [slot], [0], [n]), cache)
    return cache


# (slots, lens) of the steps compared, each row from its slot's prompt length: one decode row; four rows in
# different slots at different positions (given out of slot order); a verify step (3 tokens of one slot, each
# attending to the ones before it) next to a decode row; a short prefill chunk.
STEPS = {
    "one-row": ([2], [1]),
    "four-slots": ([3, 0, 2, 1], [1, 1, 1, 1]),
    "verify": ([1, 0], [3, 1]),
    # a 12-token prompt chunk (the layer path attends it through SDPA with a causal mask) next to a decode row
    "chunk": ([3, 0], [12, 1]),
    # 25 rows: above dense_rows, fused where the build has the paired rows (max_rows)
    "long-chunk": ([0, 2], [24, 1]),
}


def _run_step(
    model: LlamaFamilyModel,
    fused: bool,
    step: str,
    threads: int = 1,
    storage: torch.dtype | None = None,
    calculate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefilled cache, then one step, fused or layer by layer: (hidden, logits, the whole KV cache)."""
    gen = torch.Generator().manual_seed(11)
    slots, lens = STEPS[step]
    starts = [PROMPT_LENS[s] for s in slots]
    tokens = torch.randint(0, model.vocab_size, (sum(lens),), generator=gen)
    saved = fused_qdecode.enabled
    with single_torch_thread():
        fused_qdecode.enabled = False
        cache = _prefilled(model, torch.Generator().manual_seed(5), storage, calculate)
        fused_qdecode.enabled = fused
        torch.set_num_threads(threads)
        try:
            meta = _meta(model, slots, starts, lens)
            with torch.inference_mode():
                assert model.fused_quant_decode.accepts(tokens, meta, cache) == fused
                hidden = model(tokens, meta, cache)
                logits = model.compute_logits(hidden)
        finally:
            fused_qdecode.enabled = saved
            torch.set_num_threads(1)
    return hidden, logits, cache.data.clone()


def _assert_same(got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=float(r.abs().max()) * 2e-5)


@pytest.mark.parametrize("method", ["int4-g32", "int8", "fp8", "bf16"])
@pytest.mark.parametrize("step", list(STEPS))
def test_fused_step_equals_the_layer_path(kernel_path: str, method: str, step: str) -> None:
    """llama: 4 query heads on 2 KV heads (GQA), head size 16."""
    if sum(STEPS[step][1]) > fused_qdecode.max_rows():
        pytest.skip(f"{kernel_path} has no paired rows: its fused steps stop at {fused_qdecode.max_rows()} rows")
    model = _model("llama", method)
    fused = _run_step(model, True, step)
    layered = _run_step(model, False, step)
    _assert_same(fused, layered)
    slots, lens = STEPS[step]
    for slot, n in zip(slots, lens, strict=True):  # the step's K/V were written (not left as the prefill's zeros)
        assert fused[2][:, :, slot, :, PROMPT_LENS[slot] + n - 1].abs().sum() > 0


@pytest.mark.parametrize("method", ["int4-g32", "int8"])
def test_int8_activations_reach_the_fused_step(kernel_path: str, method: str) -> None:
    """``--cpu-quant-int8-activations`` rounds the fused forward's linear inputs as the layer path's kernel calls
    do (qgemm_i8.c's row kernels): the two paths agree, and both differ from the exact fp32 step."""
    model = _model("llama", method)
    for step in ("one-row", "four-slots"):  # one row: the q4 rows two at a time (AVX2)
        exact = _run_step(model, True, step)
        quant.int8_activations = True
        try:
            fused = _run_step(model, True, step)
            layered = _run_step(model, False, step)
        finally:
            quant.int8_activations = False
        _assert_same(fused, layered)
        assert not torch.equal(fused[1], exact[1])
        torch.testing.assert_close(fused[1], exact[1], rtol=0.05, atol=float(exact[1].abs().max()) * 0.05)


@pytest.mark.parametrize(
    ("storage", "calculate"),
    [(torch.float8_e4m3fn, False), (torch.float8_e5m2, False), (torch.float8_e4m3fn, True)],
    ids=["e4m3", "e5m2", "e4m3-calculated"],
)
@pytest.mark.parametrize("family", ["llama", "mistral-window", "llama-linear-bias"])
def test_fused_step_on_an_fp8_cache_equals_the_layer_path(
    kernel_path: str, family: str, storage: torch.dtype, calculate: bool
) -> None:
    """--kv-cache-dtype fp8: the fused forward writes the codes torch casts (calculated scales divided as torch
    divides) and attends with the layer path's fp8 items, so the same codes and, to fp32 rounding, the same
    outputs; windows, biases, decode and verification rows, on every kernel build."""
    model = _model(family, "int4-g32")
    for step in ("four-slots", "verify"):
        fused = _run_step(model, True, step, storage=storage, calculate=calculate)
        layer = _run_step(model, False, step, storage=storage, calculate=calculate)
        # K/V equal to fp32 rounding may still straddle a code boundary: at most a few codes, one step apart.
        codes, ref_codes = fused[2].view(torch.uint8), layer[2].view(torch.uint8)
        flipped = codes != ref_codes
        assert int(flipped.sum()) <= 2, int(flipped.sum())
        assert torch.all((codes[flipped].int() - ref_codes[flipped].int()).abs() == 1)
        if not flipped.any():
            _assert_same(fused[:2], layer[:2])


def _run_alternatives_step(
    model: LlamaFamilyModel, fused: bool, storage: torch.dtype | None, threads: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify step of two rows (slot 1: 3 tokens, slot 3: 2) with draft alternatives, two beside slot 1's first
    draft and one beside slot 3's: (hidden states of every token, the alternatives' K/V, the whole KV cache)."""
    slots, lens = [1, 3], [3, 2]
    starts = [PROMPT_LENS[s] for s in slots]
    gen = torch.Generator().manual_seed(13)
    tokens = torch.randint(0, model.vocab_size, (sum(lens) + 3,), generator=gen)
    saved = fused_qdecode.enabled
    with single_torch_thread():
        fused_qdecode.enabled = False
        cache = _prefilled(model, torch.Generator().manual_seed(5), storage)
        fused_qdecode.enabled = fused
        torch.set_num_threads(threads)
        try:
            meta = _meta(model, slots, starts, lens)
            meta.alts = DraftAlternatives(
                torch.tensor([1, 1, 3]), torch.tensor([starts[0] + 1, starts[0] + 1, starts[1] + 1])
            )
            with torch.inference_mode():
                assert model.fused_quant_decode.accepts(tokens, meta, cache) == fused
                hidden = model(tokens, meta, cache)
        finally:
            fused_qdecode.enabled = saved
            torch.set_num_threads(1)
    assert meta.alts.kv is not None
    return hidden, meta.alts.kv, cache.data.clone()


@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp32", "e4m3", "e5m2"])
@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_fused_step_with_draft_alternatives_equals_the_layer_path(
    kernel_path: str, family: str, storage: torch.dtype | None
) -> None:
    """EAGLE's tree verification: alternatives run in the fused forward, each attending its slot's keys before
    its position and its own K/V (as codes on an fp8 cache), which come back in ``alts.kv`` while the cache keeps
    the rows' own drafts; the same as the layer path to fp32 rounding, with a window too, on every build."""
    model = _model(family, "int4-g32")
    fused = _run_alternatives_step(model, True, storage)
    layer = _run_alternatives_step(model, False, storage)
    if storage is not None:  # K/V equal to fp32 rounding may straddle a code boundary: a few codes, one step apart
        codes, ref_codes = fused[2].view(torch.uint8), layer[2].view(torch.uint8)
        flipped = codes != ref_codes
        assert int(flipped.sum()) <= 2 and torch.all((codes[flipped].int() - ref_codes[flipped].int()).abs() == 1)
        if flipped.any():
            return
    _assert_same(fused[:2], layer[:2])
    # Three threads share the (group, KV head) items differently: still the same.
    threaded = _run_alternatives_step(model, True, storage, threads=3)
    _assert_same(threaded[:2], fused[:2])
    assert torch.equal(threaded[2].view(torch.uint8), fused[2].view(torch.uint8))
    if storage is None:
        _assert_same(fused[2:], layer[2:])


@pytest.mark.parametrize("step", ["four-slots", "verify"])
def test_fused_step_on_three_threads_equals_the_layer_path(kernel_path: str, step: str) -> None:
    """Rows, heads and (row, KV head) items shared out over a team: each row is still computed whole by one
    thread, so the split does not change the results (three threads: shares that do not divide evenly)."""
    model = _model("llama", "int4-g32")
    _assert_same(_run_step(model, True, step, threads=3), _run_step(model, False, step))


@pytest.mark.parametrize("family", ["llama-linear-bias", "mistral-window", "qwen2", "llama-llama3-untied", "qwen3"])
def test_fused_step_covers_biases_windows_and_head_shapes(family: str) -> None:
    """qkv/o/MLP biases, sliding windows on every layer and on some, one KV head, head size 32; qwen3's q/k norms
    are not fused and take the layer path."""
    model = _model(family, "int4-g32")
    if family == "qwen3":
        cache = model.new_kv_cache(4, MAX_LEN)
        meta = _meta(model, [0], [0], [1])
        assert not model.fused_quant_decode.accepts(torch.tensor([1]), meta, cache)
        return
    for step in ("one-row", "four-slots", "verify"):  # one row: the two-rows kernels add the biases themselves
        _assert_same(_run_step(model, True, step), _run_step(model, False, step))


@pytest.mark.parametrize("method", ["int4-g32", "bf16"])
def test_decode_steps_up_to_the_paired_limit_are_fused(kernel_path: str, method: str) -> None:
    """One-token rows are fused up to ``max_decode_rows()`` (the paired rows' limit: 64 in the AVX2 build), past
    ``max_rows()``; a prompt chunk of as many tokens keeps the layer path. Fused equals the layer path there."""
    model = _model("llama", method)
    n = 40
    gen = torch.Generator().manual_seed(3)
    cache = model.new_kv_cache(n, MAX_LEN)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    tokens = torch.randint(0, model.vocab_size, (n,), generator=gen)
    starts = [(5 + 7 * i) % (MAX_LEN - 1) for i in range(n)]
    limit = fused_qdecode.max_decode_rows()
    assert limit == max(fused_qdecode.max_rows(), quant.kernel_rows())
    if kernel_path == "avx2":
        assert limit == 64
    fused = model.fused_quant_decode
    saved = fused_qdecode.enabled
    runs = []
    try:
        with torch.inference_mode():
            assert fused.accepts(tokens, _meta(model, list(range(n)), starts, [1] * n), cache) == (n <= limit)
            assert not fused.accepts(tokens, _meta(model, [0], [0], [n]), cache)  # a 40-token prompt chunk
            for on in (True, False):
                fused_qdecode.enabled = on
                step_cache = model.new_kv_cache(n, MAX_LEN)
                step_cache.data.copy_(cache.data)
                hidden = model(tokens, _meta(model, list(range(n)), starts, [1] * n), step_cache)
                runs.append((hidden, model.compute_logits(hidden), step_cache.data))
    finally:
        fused_qdecode.enabled = saved
    _assert_same(runs[0], runs[1])


def test_accepts_falls_back_where_it_does_not_apply() -> None:
    model = _model("llama", "int4-g32")
    cache = model.new_kv_cache(4, MAX_LEN)
    fused = model.fused_quant_decode
    with torch.inference_mode():
        assert fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), cache)
        rows = fused_qdecode.max_rows()
        assert rows == (quant.KERNEL_ROWS if cpu_kernels.built("qgemm_paired_available") else quant.dense_rows)
        assert fused.accepts(torch.zeros(rows, dtype=torch.long), _meta(model, [0], [0], [rows]), cache)
        # more rows than the quantized linears run on their codes: a prefill chunk keeps the layer path
        assert not fused.accepts(torch.zeros(rows + 1, dtype=torch.long), _meta(model, [0], [0], [rows + 1]), cache)
        # a slot outside this cache
        assert not fused.accepts(torch.tensor([1]), _meta(model, [5], [3], [1]), cache)
        # an fp8 KV cache: fused, but not before its calculated scales are set (the layer path sets them)
        fp8_cache = model.new_kv_cache(4, MAX_LEN, storage=torch.float8_e4m3fn)
        assert fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), fp8_cache)
        pending = model.new_kv_cache(4, MAX_LEN, storage=torch.float8_e4m3fn, calculate_scales=True)
        assert not fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), pending)
        # a dense layer among the quantized ones
        layer = model.layers[1]
        saved = layer.o_weight
        del layer.o_weight
        layer.o_weight = torch.nn.Parameter(saved.dequantize(), requires_grad=False)
        assert not fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), cache)
        del layer._parameters["o_weight"]
        layer.o_weight = saved
        assert fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), cache)
        # a norm's weight replaced (the layers are looked at again after any assignment on a norm too)
        norm = model.layers[0].post_norm
        fp32_weight = norm.weight
        norm.weight = torch.nn.Parameter(fp32_weight.detach().to(torch.bfloat16), requires_grad=False)
        assert not fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), cache)
        norm.weight = fp32_weight
        assert fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), cache)
    with forced_cpu_path("none"):
        assert not fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), cache)
    with forced_cpu_path(KERNEL_PATHS[0], fused_quant_decode=False):
        assert not fused.accepts(torch.tensor([1]), _meta(model, [0], [3], [1]), cache)
    dense = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.float32, torch.device("cpu"), MAX_LEN)
    assert not dense.fused_quant_decode.accepts(torch.tensor([1]), _meta(dense, [0], [3], [1]), cache)


def test_a_weight_swapped_after_a_fused_step_reaches_the_next_one() -> None:
    model = _model("llama", "int4-g32")
    cache = model.new_kv_cache(1, MAX_LEN)  # the same cache throughout: only the weights' key can rebuild the table
    token = torch.tensor([7])
    saved = fused_qdecode.enabled
    with single_torch_thread(), torch.inference_mode():
        try:
            fused_qdecode.enabled = True
            assert model.fused_quant_decode.accepts(token, _meta(model, [0], [0], [1]), cache)
            before = model(token, _meta(model, [0], [0], [1]), cache).clone()  # builds the C layer table
            layer = model.layers[0]
            doubled = quant.quantize(layer.down_weight.dequantize() * 2, "int4-g32")
            del layer.down_weight
            layer.down_weight = doubled
            fused = model(token, _meta(model, [0], [0], [1]), cache).clone()
            fused_qdecode.enabled = False
            layered = model(token, _meta(model, [0], [0], [1]), cache)
        finally:
            fused_qdecode.enabled = saved
    _assert_same((fused,), (layered,))
    assert not torch.allclose(fused, before)


def test_switch_flag_reaches_the_cpu_options() -> None:
    from nxdserve.cli import build_parser, engine_config_from_args

    assert CpuOptions().fused_quant_decode
    args = build_parser().parse_args(["--no-cpu-fused-quant-decode"])
    assert not engine_config_from_args(args).cpu.fused_quant_decode


def _count_runs(fused: fused_qdecode.FusedQuantDecode) -> list[int]:
    """Record each fused forward (one entry per call) on this instance."""
    runs: list[int] = []
    real_run = fused.run

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        runs.append(1)
        return real_run(*args, **kwargs)

    fused.run = run  # type: ignore[method-assign]
    return runs


def test_default_model_greedy_text_is_the_same_with_the_switch_on_and_off() -> None:
    """The default model served from its Q4_1 blocks: batched greedy decode (several slots, each step fused)."""
    from nxdserve.sampling_params import SamplingParams
    from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize

    outputs, fused_steps = [], []
    for on in (True, False):
        # Asked for explicitly: the default is dense bf16 on CPUs with the fused bf16 decoder (AVX512-BF16, AMX).
        core = make_core(
            dtype="float32",
            quantization="gguf",
            max_model_len=128,
            max_num_seqs=4,
            cpu=CpuOptions(fused_quant_decode=on),
        )
        model = core.backend.model  # type: ignore[attr-defined]
        assert isinstance(model.layers[0].gate_up_weight, quant.QuantLinear)  # served from the file's blocks
        runs = _count_runs(model.fused_quant_decode)
        prompts = tokenize(core, PROMPTS[:4])
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outputs.append([list(o.outputs[0].token_ids) for o in run_to_completion(core, prompts, params)])
        fused_steps.append(len(runs))
    assert fused_steps[0] >= 11 and fused_steps[1] == 0
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[0])


@pytest.mark.parametrize("head", ["q8_0", "int4", "int8", "fp8"])
def test_quantized_head_greedy_is_the_argmax_of_its_logits(kernel_path: str, head: str) -> None:
    """``compute_greedy`` on a quantized LM head (the row kernel's argmax, no logits read back): the index of
    ``compute_logits``' largest value among the first ``vocab`` columns; None for inputs it cannot take exactly."""
    model = _model("llama", "int4-g32")
    dense = model.lm_head_weight
    makers = {"q8_0": quant.quantize_q8_0, "int4": lambda w: quant.quantize_int4(w, 32), "int8": quant.quantize_int8,
              "fp8": quant.quantize_fp8}  # fmt: skip
    model.lm_head_quant = makers[head](dense)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3, 9):
        hidden = torch.randn(rows, model.hidden_size, generator=gen)
        logits = model.compute_logits(hidden)
        for vocab in (model.vocab_size, model.vocab_size - 7):
            expected = cpu_kernels.argmax(logits[:, :vocab].contiguous())
            got = model.compute_greedy(hidden, vocab)
            assert got is not None and got.tolist() == expected.tolist()
    assert model.compute_greedy(hidden.to(torch.bfloat16), model.vocab_size) is None  # bf16 logits round first


def test_default_model_greedy_text_is_the_same_with_tokens_from_the_head() -> None:
    """The default model's Q4_1 blocks and Q8_0 head: greedy decode takes its tokens from the head kernel's argmax
    and gives the text that the sampler's argmax over the logits gives."""
    from nxdserve.sampling_params import SamplingParams
    from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize

    outputs, head_calls = [], []
    real_argmax = cpu_weight_kernels.QgemmWeight.argmax
    for from_head in (True, False):
        core = make_core(dtype="float32", quantization="gguf", max_model_len=128, max_num_seqs=4)
        backend: Any = core.backend
        assert backend._greedy_from_head  # a quantized head on the CPU
        backend._greedy_from_head = from_head
        calls: list[int] = []

        def counted(self: cpu_weight_kernels.QgemmWeight, *args: Any, calls: list[int] = calls) -> torch.Tensor:
            calls.append(1)
            return real_argmax(self, *args)

        cpu_weight_kernels.QgemmWeight.argmax = counted  # type: ignore[method-assign]
        try:
            prompts = tokenize(core, PROMPTS[:3])
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            outputs.append([list(o.outputs[0].token_ids) for o in run_to_completion(core, prompts, params)])
        finally:
            cpu_weight_kernels.QgemmWeight.argmax = real_argmax  # type: ignore[method-assign]
        head_calls.append(len(calls))
    assert head_calls[0] >= 9 and head_calls[1] == 0
    assert outputs[0] == outputs[1]
