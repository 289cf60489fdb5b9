"""Our Llama-family modelling against transformers' implementation of the same checkpoints (fp32).

Every test runs token sequences through ``SlotModelRunner`` in some schedule (whole prefill, chunks of
several sizes, decode steps, mixed batches over several slots) and compares the logits of every
position with transformers' logits for the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from nxdserve.engine.models import AttentionMetadata, ModelSpec, SlotModelRunner, resolve_device, resolve_dtype
from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import (
    TINY_FAMILIES,
    VOCAB_SIZE,
    build_tiny_model,
    reference_model,
    single_torch_thread,
    tiny_model_path,
)

FAMILIES = sorted(TINY_FAMILIES)
ATOL_TINY = 1e-4
# SmolLM2's logits reach ~35 after 30 layers, and fp32 reduction order alone moves them by ~1e-3:
# transformers' own cached decode differs from its own full forward by up to 1.2e-3 on these inputs
# (eager vs sdpa: 7e-4). 5e-3 is ~1.5e-4 relative; a real bug moves logits by whole units.
ATOL_DEFAULT = 5e-3
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def reference_logits(path: Path, ids: Sequence[int]) -> torch.Tensor:
    return _reference_logits(path, tuple(ids))


@cache
def _reference_logits(path: Path, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(path)(torch.tensor([ids])).logits[0]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_schedule(
    runner: SlotModelRunner,
    seqs: dict[int, list[int]],
    steps: list[list[tuple[int, int]]],
) -> dict[int, torch.Tensor]:
    """Run ``steps`` (each a list of (slot, num_tokens) rows) and return each slot's logits per position."""
    progress = dict.fromkeys(seqs, 0)
    logits: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in steps:
        step = sorted(step)  # plans come sorted by slot
        slots = np.array([s for s, _ in step])
        lens = np.array([n for _, n in step])
        starts = np.array([progress[s] for s, _ in step])
        tokens = torch.tensor([t for s, n in step for t in seqs[s][progress[s] : progress[s] + n]])
        out = runner.logits(runner.run(tokens, slots, starts, lens))
        offset = 0
        for s, n in step:
            logits[s].append(out[offset : offset + n])
            offset += n
            progress[s] += n
    return {s: torch.cat(parts) for s, parts in logits.items() if parts}


def chunk_steps(slot: int, total: int, chunk: int) -> list[list[tuple[int, int]]]:
    return [[(slot, min(chunk, total - start))] for start in range(0, total, chunk)]


def random_mixed_schedule(lengths: dict[int, int], seed: int) -> list[list[tuple[int, int]]]:
    """Steps where each unfinished slot runs a row of a random size (decode-sized rows, short chunks
    that share the batched SDPA, long chunks that get their own) or sits the step out."""
    rng = np.random.default_rng(seed)
    menu = [1, 1, 1, 2, 4, 7, 9, 16, 23]
    progress = dict.fromkeys(lengths, 0)
    steps = []
    while any(progress[s] < lengths[s] for s in lengths):
        step = []
        for s in lengths:
            left = lengths[s] - progress[s]
            if left and rng.random() < 0.8:
                n = min(int(rng.choice(menu)), left)
                step.append((s, n))
                progress[s] += n
        if step:
            steps.append(step)
    return steps


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= atol, f"max |ours - transformers| = {err:.3g} > {atol}"


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest) -> tuple[Path, SlotModelRunner]:
    path = tiny_model_path(request.param)
    return path, SlotModelRunner.from_pretrained(path, num_slots=6, max_len=64, dtype=torch.float32, device=CPU)


def test_full_prefill_matches_transformers(tiny: tuple[Path, SlotModelRunner]) -> None:
    path, runner = tiny
    ids = random_ids(48, seed=1)
    got = run_schedule(runner, {2: ids}, [[(2, len(ids))]])
    assert_close(got[2], reference_logits(path, ids), ATOL_TINY)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_matches_transformers(tiny: tuple[Path, SlotModelRunner], chunk: int) -> None:
    path, runner = tiny
    ids = random_ids(40, seed=2)
    got = run_schedule(runner, {4: ids}, chunk_steps(4, len(ids), chunk))
    assert_close(got[4], reference_logits(path, ids), ATOL_TINY)


def test_decode_matches_transformers(tiny: tuple[Path, SlotModelRunner]) -> None:
    """Prefill four slots, then decode them together: contiguous slots (a cache view) and a gap (gather)."""
    path, runner = tiny
    seqs = {s: random_ids(30, seed=10 + s) for s in (0, 1, 2, 4)}
    steps: list[list[tuple[int, int]]] = [[(s, 20) for s in seqs]]
    steps += [[(s, 1) for s in seqs] for _ in range(6)]  # all four: gathered (slot 3 missing)
    steps += [[(s, 1) for s in (0, 1, 2)] for _ in range(4)]  # consecutive slots 0..2: a view
    steps += [[(4, 1)] for _ in range(4)]
    got = run_schedule(runner, seqs, steps)
    for s, ids in seqs.items():
        n = got[s].shape[0]
        assert_close(got[s], reference_logits(path, ids)[:n], ATOL_TINY)


def test_mixed_batch_matches_transformers(tiny: tuple[Path, SlotModelRunner]) -> None:
    """Decode rows, verification-sized rows and chunks of several slots in the same forwards."""
    path, runner = tiny
    lengths = {0: 37, 1: 52, 3: 18, 5: 60}
    seqs = {s: random_ids(n, seed=20 + s) for s, n in lengths.items()}
    got = run_schedule(runner, seqs, random_mixed_schedule(lengths, seed=0))
    for s, ids in seqs.items():
        assert_close(got[s], reference_logits(path, ids), ATOL_TINY)


def test_slot_reuse_ignores_stale_cache(tiny: tuple[Path, SlotModelRunner]) -> None:
    """A slot that held a longer sequence serves a new one: the old tail must stay masked."""
    path, runner = tiny
    old, new = random_ids(60, seed=30), random_ids(25, seed=31)
    run_schedule(runner, {1: old}, [[(1, 60)]])
    got = run_schedule(runner, {1: new}, [[(1, 10)], [(1, 1)], [(1, 3)], [(1, 11)]])
    assert_close(got[1], reference_logits(path, new), ATOL_TINY)


def test_sliding_window_is_in_effect() -> None:
    """Guard against a vacuous pass: without its windows the Qwen2 tiny model gives other logits."""
    path = tiny_model_path("qwen2")
    runner = SlotModelRunner.from_pretrained(path, num_slots=1, max_len=64, dtype=torch.float32, device=CPU)
    assert runner.model.spec.sliding_windows == (None, 5)
    ids = random_ids(30, seed=3)
    ref = reference_logits(path, ids)
    for layer in runner.model.layers:
        layer.window = None
    runner.model.windows = frozenset([None])
    got = run_schedule(runner, {0: ids}, [[(0, 30)]])
    assert (got[0] - ref).abs().max().item() > 0.1


def test_default_model_matches_transformers() -> None:
    """SmolLM2-135M (30 layers, 9:3 GQA, tied head) through a mixed schedule over four slots."""
    _check_default_model(lengths={0: 40, 1: 33, 2: 64, 5: 21}, seed=1)


def _check_default_model(lengths: dict[int, int], seed: int) -> None:
    from nxdserve.model_files import resolve_model

    path = resolve_model(None, progress=False)
    runner = SlotModelRunner.from_pretrained(path, num_slots=6, max_len=128, dtype=torch.float32, device=CPU)
    seqs = {s: random_ids(n, seed=40 + s) for s, n in lengths.items()}
    got = run_schedule(runner, seqs, random_mixed_schedule(lengths, seed=seed))
    for s, ids in seqs.items():
        assert_close(got[s], reference_logits(path, ids), ATOL_DEFAULT)


def test_bfloat16_stays_close_to_float32() -> None:
    path = tiny_model_path("llama")
    ids = random_ids(32, seed=5)
    ref = reference_logits(path, ids)
    runner = SlotModelRunner.from_pretrained(path, num_slots=2, max_len=64, dtype=torch.bfloat16, device=CPU)
    got = run_schedule(runner, {1: ids}, chunk_steps(1, 32, 5))[1]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.25 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


# -- metadata, loading and config errors -----------------------------------------------------------------


def test_metadata_rejects_bad_rows() -> None:
    kw = {"num_query_groups": 2, "windows": frozenset([None]), "max_len": 16, "device": CPU}
    with pytest.raises(ValueError, match="past the cache line"):
        AttentionMetadata.build(np.array([0]), np.array([10]), np.array([7]), **kw)
    with pytest.raises(ValueError, match="more than one row"):
        AttentionMetadata.build(np.array([1, 1]), np.array([0, 3]), np.array([3, 1]), **kw)
    with pytest.raises(ValueError, match="at least one token"):
        AttentionMetadata.build(np.array([0]), np.array([0]), np.array([0]), **kw)


def test_metadata_plain_decode_needs_no_gather() -> None:
    kw = {"num_query_groups": 2, "windows": frozenset([None]), "max_len": 16, "device": CPU}
    meta = AttentionMetadata.build(np.array([2, 3, 4]), np.array([5, 9, 1]), np.array([1, 1, 1]), **kw)
    assert meta.batched is not None and meta.batched.query_index is None and meta.batched.slot_start == 2
    assert meta.positions.tolist() == [5, 9, 1] and not meta.chunks
    meta = AttentionMetadata.build(np.array([0, 3]), np.array([5, 0]), np.array([1, 12]), **kw)
    assert meta.batched is not None and meta.batched.slot_start == 0 and len(meta.chunks) == 1


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("slots", [[2, 3, 4], [0, 5, 1, 7]])
def test_metadata_decode_shortcut_is_the_general_build(
    kernel: bool, slots: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of one token each take ``_decode_rows``; it must make what the general build makes of them, masks
    (sliding window and full) included, in slot order and out of it."""
    from nxdserve.engine.models import attention

    kw = {"num_query_groups": 3, "windows": frozenset([None, 4]), "max_len": 32, "device": CPU,
          "dtype": torch.float32, "attention_kernel": kernel}  # fmt: skip
    starts = [5, 9, 1, 30][: len(slots)]
    made = []
    for shortcut in (True, False):
        monkeypatch.setattr(attention, "decode_rows_shortcut", shortcut)
        made.append(AttentionMetadata.build(np.array(slots), np.array(starts), np.ones(len(slots), np.int64), **kw))
    fast, general = made
    for name in ("num_tokens", "chunks", "use_kernel", "kernel_count", "max_slot", "max_end", "alts", "lora"):
        assert getattr(fast, name) == getattr(general, name), name
    assert fast.kernel_select is None and general.kernel_select is None
    assert fast.positions.tolist() == general.positions.tolist() == starts
    assert fast.write_slots.tolist() == general.write_slots.tolist() == slots
    a, b = fast.batched, general.batched
    assert a is not None and b is not None
    for name in ("num_rows", "num_queries", "ctx_len", "slot_start", "query_index", "valid_index", "token_index",
                 "num_query_groups", "dtype"):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name
    assert a.slots.tolist() == b.slots.tolist() and a.query_pos.tolist() == b.query_pos.tolist()
    assert a.masks.keys() == b.masks.keys() == (set() if kernel else {None, 4})  # the kernel needs no masks
    for window in (None, 4):
        torch.testing.assert_close(a.mask(window), b.mask(window), atol=0, rtol=0)


def test_boolean_and_additive_masks_agree() -> None:
    """Callers that build metadata without a dtype get boolean masks; both forms give the same output."""
    path = tiny_model_path("mistral-window")
    runner = SlotModelRunner.from_pretrained(path, num_slots=4, max_len=64, dtype=torch.float32, device=CPU)
    ids = torch.tensor(random_ids(24, seed=6))
    rows = (np.array([0, 2]), np.array([0, 0]), np.array([4, 20]))  # one batched row, one chunk
    outs = []
    for dtype in (None, torch.float32):
        meta = AttentionMetadata.build(
            *rows, num_query_groups=2, windows=runner.model.windows, max_len=64, device=CPU, dtype=dtype
        )
        assert meta.chunks[0].masks[6].dtype == (torch.bool if dtype is None else dtype)
        outs.append(runner.model(ids, meta, runner.kv_cache))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_unsupported_model_type_is_a_config_error() -> None:
    from transformers import GPT2Config

    with pytest.raises(ConfigError, match="not supported"):
        ModelSpec.from_hf_config(GPT2Config())


def test_missing_and_unexpected_tensors_are_config_errors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = build_tiny_model("llama", tmp_path / "m", with_tokenizer=False)
    weights = load_file(str(path / "model.safetensors"))
    model = LlamaFamilyModel.from_pretrained(path, torch.float32, CPU)
    partial = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ConfigError, match="missing"):
        model.load_weights(partial.items())
    with pytest.raises(ConfigError, match="Unexpected"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing"):
        LlamaFamilyModel.from_pretrained(path, torch.float32, CPU)


def test_dtype_and_device_resolution() -> None:
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    assert resolve_dtype("auto", CPU) in (torch.float32, torch.bfloat16)
    # A forced build without native bf16 stands for such a CPU: its default dtype, fp32, whatever this CPU has.
    for isa in ("avx2", "generic"):
        assert resolve_dtype("auto", CPU, isa) == torch.float32
        assert resolve_dtype("bfloat16", CPU, isa) == torch.bfloat16  # an explicit dtype still wins
    for isa in ("auto", "amx", "avx512bf16", "none"):
        assert resolve_dtype("auto", CPU, isa) == resolve_dtype("auto", CPU)
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ConfigError):
        resolve_dtype("int8", CPU)
