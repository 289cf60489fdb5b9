"""The fused small-batch bf16 forward (``fused_decode``) against the layer-by-layer path and fp32."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from nxdserve.engine.models import cpu_kernels, fused_decode, gemm
from nxdserve.engine.models.attention import AttentionMetadata, SlotKVCache
from nxdserve.engine.models.llama import LlamaFamilyModel
from tests.helpers.tiny_model import _llama, single_torch_thread, slot_meta, tiny_model_path

needs_fused = pytest.mark.skipif(not fused_decode.available(), reason="no AVX512-BF16 C kernels on this machine")
MAX_LEN = 64
PROMPT_LEN = 20


CUSTOM_CONFIGS = {
    # hidden 80 and intermediate 136: projections whose sizes are not multiples of the GEMM's 48-column
    # panels or 16-lane vectors (the masked tails), five query heads on one KV head.
    "odd": {
        "hidden_size": 80,
        "intermediate_size": 136,
        "num_attention_heads": 5,
        "num_key_value_heads": 1,
        "head_dim": 16,
    },
    # SmolLM2's attention shape (head size 64, three query heads per KV head): the vectorised item kernel.
    "d64-g3": {
        "hidden_size": 192,
        "intermediate_size": 256,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 64,
    },
    # An intermediate size whose down projection takes 64 rows a row block: a 200-token forward runs it in
    # four blocks, each with its own panel runs for work stealing.
    "wide-mlp": {
        "hidden_size": 192,
        "intermediate_size": 2048,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 64,
    },
}


@pytest.fixture(scope="module")
def custom_model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    paths = {}
    for name, overrides in CUSTOM_CONFIGS.items():
        config = _llama(**overrides, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                noise = torch.randn(param.shape)
                param.copy_(1.0 + 0.2 * noise if pname.endswith("norm.weight") else 0.15 * noise)
        out = tmp_path_factory.mktemp(name) / name
        model.save_pretrained(str(out), safe_serialization=True)
        paths[name] = out
    return paths


_meta = functools.partial(slot_meta, max_len=MAX_LEN)  # one step's AttentionMetadata in a MAX_LEN cache


CHUNK_START, CHUNK_LEN = 8, 12


def _prefilled(
    model: LlamaFamilyModel, prompts: list[torch.Tensor], storage: torch.dtype | None = None, calculate: bool = False
) -> SlotKVCache:
    """Every prompt prefilled in one row, except the last: only its first CHUNK_START tokens. ``storage``,
    ``calculate``: an fp8 cache, with scales from the first prompt's K/V."""
    cache = model.new_kv_cache(len(prompts), MAX_LEN, storage, calculate)
    for slot, prompt in enumerate(prompts):
        part = prompt[:CHUNK_START] if slot == len(prompts) - 1 else prompt
        model(part, _meta(model, [slot], [0], [part.numel()]), cache)
    return cache


def _step(
    path: Path,
    fused: bool,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    storage: torch.dtype | None = None,
    calculate: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Prefill four slots, then one step of 17 tokens: slots 0 and 1 decode, slot 2 verifies 3 tokens and
    slot 3 runs a 12-token prefill chunk from position 8 (its tokens attend causally to each other). ``storage``,
    ``calculate``: the KV cache's (``_prefilled``)."""
    model = LlamaFamilyModel.from_pretrained(path, dtype, torch.device("cpu"), max_len=MAX_LEN)
    gen = torch.Generator().manual_seed(7)
    vocab = model.vocab_size
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen) for _ in range(4)]
    tokens = torch.cat([torch.randint(0, vocab, (5,), generator=gen), prompts[3][CHUNK_START:]])
    monkeypatch.setattr(fused_decode, "enabled", fused)
    with single_torch_thread():
        cache = _prefilled(model, prompts, storage, calculate)
        meta = _meta(model, [0, 2, 1, 3], [PROMPT_LEN] * 3 + [CHUNK_START], [1, 3, 1, CHUNK_LEN])
        with torch.inference_mode():
            assert model.fused_decode.accepts(tokens, meta, cache) == (fused and dtype == torch.bfloat16)
        hidden = model(tokens, meta, cache)
        logits = model.compute_logits(hidden)
    written = torch.cat(
        [
            cache.data[:, :, :3, :, PROMPT_LEN : PROMPT_LEN + 3].flatten(),
            cache.data[:, :, 3, :, CHUNK_START:PROMPT_LEN].flatten(),
        ]
    ).float()
    return hidden.float(), logits, written


@needs_fused
@pytest.mark.parametrize(
    "family", ["llama", "llama-llama3-untied", "llama-linear-bias", "mistral-window", "qwen2", *CUSTOM_CONFIGS]
)
def test_fused_forward_is_as_close_to_fp32_as_the_layer_path(
    family: str, custom_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = custom_model_paths[family] if family in CUSTOM_CONFIGS else tiny_model_path(family)
    _fused_as_close_as_the_layer_path(*(_step(path, fused, dtype, monkeypatch) for fused, dtype in _PATHS))


_PATHS = ((False, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16))  # reference, layer, fused


def _fused_as_close_as_the_layer_path(
    ref: tuple[torch.Tensor, ...],
    layer: tuple[torch.Tensor, ...],
    fused: tuple[torch.Tensor, ...],
    kv_apart: float = 0.1,
) -> None:
    """Both bf16 paths round at the same places; only the order of fp32 sums inside projections differs.
    A wrong RoPE, attention span, bias or residual would put the fused path far outside the layer path's
    error against fp32. Outputs: hidden states, logits, the step's K/V in the cache (``kv_apart``: how far
    apart the two paths' K/V may be, relative to the largest; one e5m2 step is a quarter of a value)."""
    for i, (fused_out, layer_out, ref_out) in enumerate(zip(fused, layer, ref, strict=True)):
        scale = ref_out.abs().max().item()
        fused_err = (fused_out - ref_out).abs().max().item()
        layer_err = (layer_out - ref_out).abs().max().item()
        assert fused_err <= 2 * layer_err + 0.02 * scale, (fused_err, layer_err, scale)
        assert (fused_out - layer_out).abs().max().item() <= (kv_apart if i == 2 else 0.1) * scale
    assert (fused[1].argmax(-1) == layer[1].argmax(-1)).float().mean().item() >= 0.6


@needs_fused
@pytest.mark.parametrize(
    ("storage", "calculate"),
    [(torch.float8_e4m3fn, False), (torch.float8_e5m2, False), (torch.float8_e4m3fn, True)],
    ids=["e4m3", "e5m2", "e4m3-calculated"],
)
@pytest.mark.parametrize("family", ["llama", "mistral-window", "odd", "d64-g3"])
def test_fused_forward_on_an_fp8_cache_is_as_close_to_fp32_as_the_layer_path(
    family: str,
    storage: torch.dtype,
    calculate: bool,
    custom_model_paths: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--kv-cache-dtype fp8``: the fused forward writes the codes and attends over them (widened per item; the
    head-size-64 items and blocks in d64-g3, the generic items in odd, windows in mistral-window; calculated
    scales apply K's to the scores and V's to the outputs). The reference is the fp32 model on the same format."""
    path = custom_model_paths[family] if family in CUSTOM_CONFIGS else tiny_model_path(family)
    outputs = [_step(path, fused, dtype, monkeypatch, storage, calculate) for fused, dtype in _PATHS]
    _fused_as_close_as_the_layer_path(*outputs, kv_apart=0.25)
    layer_kv, fused_kv = outputs[1][2], outputs[2][2]
    # The codes themselves: K/V computed in another sum order take another code where they straddle a step (with
    # a bf16 cache 79% of this step's K/V are equal between the paths on llama, with fp8 95-97% of the codes); a
    # wrong format or scale would leave few equal.
    assert (layer_kv == fused_kv).float().mean().item() >= 0.9


@needs_fused
@pytest.mark.parametrize("family", ["d64-g3"])
def test_block_attention_agrees_with_single_token_items(
    family: str, custom_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of tokens in one row (the prefill chunk, the verification rows) attend as blocks that share
    each key read; with blocks turned off every token is its own item. Only fp32 summation order differs."""
    path = custom_model_paths[family] if family in CUSTOM_CONFIGS else tiny_model_path(family)
    lib = cpu_kernels._library()
    assert lib is not None
    default = lib.decode_forward_block_min()
    try:
        lib.decode_forward_set_block_min(10**9)
        items = _step(path, True, torch.bfloat16, monkeypatch)
        lib.decode_forward_set_block_min(2)
        blocks = _step(path, True, torch.bfloat16, monkeypatch)
    finally:
        lib.decode_forward_set_block_min(default)
    for block_out, item_out in zip(blocks, items, strict=True):
        scale = item_out.abs().max().item()
        assert (block_out - item_out).abs().max().item() <= 0.02 * scale


@needs_fused
@pytest.mark.parametrize("seed", range(4))
def test_block_attention_agrees_with_items_on_random_steps(
    seed: int, custom_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random mixes of decodes, verification rows and chunks whose key counts fall on and around the
    kernel's 16-key tiles and 32-key rows (and blocks cut at 8 tokens): blocks agree with per-token items."""
    rng = np.random.default_rng(seed)
    max_len = 128
    model = LlamaFamilyModel.from_pretrained(custom_model_paths["d64-g3"], torch.bfloat16, torch.device("cpu"), max_len)
    monkeypatch.setattr(fused_decode, "enabled", True)
    slots = rng.permutation(8)[: int(rng.integers(2, 7))]
    starts = rng.choice([0, 1, 15, 16, 17, 30, 31, 32, 33, 63, 64, 90], size=slots.size)
    lens = np.array([int(rng.choice([1, 2, 3, 5, 8, 9, 16, 17, 33])) for _ in slots])
    lens = np.minimum(lens, max_len - starts)
    history = torch.randint(0, model.vocab_size, (8, max_len), generator=torch.Generator().manual_seed(seed))
    groups = model.spec.num_heads // model.spec.num_kv_heads
    meta = AttentionMetadata.build(
        slots, starts, lens, num_query_groups=groups, windows=model.windows, max_len=max_len,
        device=torch.device("cpu"), dtype=model.dtype,
    )  # fmt: skip
    tokens = torch.cat([history[s, b : b + n] for s, b, n in zip(slots, starts, lens, strict=True)])
    lib = cpu_kernels._library()
    assert lib is not None
    outputs = []
    default = lib.decode_forward_block_min()
    for block_min in (2, 10**9):
        lib.decode_forward_set_block_min(block_min)
        try:
            cache = model.new_kv_cache(8, max_len)
            with single_torch_thread(), torch.inference_mode():
                for s, b in zip(slots, starts, strict=True):  # the context before each row, layer path
                    if b:
                        model(history[s, :b], _meta_len(model, [int(s)], [0], [int(b)], max_len), cache)
                assert model.fused_decode.accepts(tokens, meta, cache)
                outputs.append(model(tokens, meta, cache).float())
        finally:
            lib.decode_forward_set_block_min(default)
    scale = outputs[1].abs().max().item()
    assert (outputs[0] - outputs[1]).abs().max().item() <= 0.02 * scale


def _meta_len(
    model: LlamaFamilyModel, slots: list[int], starts: list[int], lens: list[int], max_len: int
) -> AttentionMetadata:
    groups = model.spec.num_heads // model.spec.num_kv_heads
    return AttentionMetadata.build(
        np.array(slots), np.array(starts), np.array(lens), num_query_groups=groups, windows=model.windows,
        max_len=max_len, device=torch.device("cpu"), dtype=model.dtype,
    )  # fmt: skip


@needs_fused
def test_whole_long_prompt_runs_fused_as_close_to_fp32_as_the_layer_path(
    custom_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 300-token prompt in one forward (prefill-first mode admits whole prompts) takes the fused path:
    38 blocks of up to 8 tokens over up to 300 keys, where the layer path uses SDPA."""
    path, length, max_len = custom_model_paths["d64-g3"], 300, 320
    tokens = torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(11))
    logits = {}
    for name, dtype, fused in (("ref", torch.float32, False), ("layer", torch.bfloat16, False),
                               ("fused", torch.bfloat16, True)):
        monkeypatch.setattr(fused_decode, "enabled", fused)
        model = LlamaFamilyModel.from_pretrained(path, dtype, torch.device("cpu"), max_len=max_len)
        tokens = tokens % model.vocab_size
        groups = model.spec.num_heads // model.spec.num_kv_heads
        meta = AttentionMetadata.build(
            np.array([1]), np.array([0]), np.array([length]), num_query_groups=groups,
            windows=model.windows, max_len=max_len, device=torch.device("cpu"), dtype=model.dtype,
        )  # fmt: skip
        cache = model.new_kv_cache(2, max_len)
        with single_torch_thread(), torch.inference_mode():
            assert model.fused_decode.accepts(tokens, meta, cache) == fused
            logits[name] = model.compute_logits(model(tokens, meta, cache)).float()
    scale = logits["ref"].abs().max().item()
    fused_err = (logits["fused"] - logits["ref"]).abs().max().item()
    layer_err = (logits["layer"] - logits["ref"]).abs().max().item()
    assert fused_err <= 2 * layer_err + 0.02 * scale, (fused_err, layer_err, scale)
    assert (logits["fused"].argmax(-1) == logits["layer"].argmax(-1)).float().mean().item() >= 0.6


@needs_fused
@pytest.mark.parametrize(
    ("family", "lens"),
    [
        # Decodes, a verification row and a 40-token chunk: 45 tokens, inside one row block of every projection.
        ("odd", [1, 3, 1, 40]),
        ("d64-g3", [1, 3, 1, 40]),
        # Five 40-token chunks, 200 tokens: the down projection in four row blocks, the others in one.
        ("wide-mlp", [40, 40, 40, 40, 40]),
    ],
)
def test_fused_forward_gives_the_same_bits_on_any_thread_count(
    family: str, lens: list[int], custom_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads share each projection's panels by work stealing, and a panel's output does not depend on who
    computes it. More threads than cores (5 on the 2-core CI machine) get descheduled mid-GEMM, so the others
    take over their panels; a panel claimed twice or never would change the bits (or leave stale output)."""
    path = custom_model_paths[family]
    monkeypatch.setattr(fused_decode, "enabled", True)
    model = LlamaFamilyModel.from_pretrained(path, torch.bfloat16, torch.device("cpu"), max_len=MAX_LEN)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.vocab_size, (sum(lens),), generator=gen)
    slots = list(range(len(lens)))
    starts = [0 if n > 3 else PROMPT_LEN for n in lens]
    meta = _meta(model, slots, starts, lens)
    lib = cpu_kernels._library()
    assert lib is not None
    lib.gemm_set_x_block_bytes(256 * 1024)  # the row blocks the comments count, whatever this machine's L2
    before = torch.get_num_threads()
    outputs = []
    try:
        for threads, stealing in ((1, 1), (2, 1), (3, 1), (5, 1), (5, 1), (5, 1), (2, 0), (5, 0)):
            torch.set_num_threads(threads)
            lib.gemm_set_work_stealing(stealing)
            cache = model.new_kv_cache(len(lens), MAX_LEN)
            cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(9)))
            with torch.inference_mode():
                assert model.fused_decode.accepts(tokens, meta, cache)
                outputs.append((model.compute_logits(model(tokens, meta, cache)), cache.data.clone()))
    finally:
        torch.set_num_threads(before)
        lib.gemm_set_work_stealing(1)
        lib.gemm_set_x_block_bytes(0)
    for logits, kv in outputs[1:]:
        assert torch.equal(logits, outputs[0][0]) and torch.equal(kv, outputs[0][1])


@needs_fused
def test_fused_forward_is_not_used_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_decode, "enabled", True)
    bf16 = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.bfloat16, torch.device("cpu"), MAX_LEN)
    fp32 = LlamaFamilyModel.from_pretrained(tiny_model_path("llama"), torch.float32, torch.device("cpu"), MAX_LEN)
    qk_norm = LlamaFamilyModel.from_pretrained(tiny_model_path("qwen3"), torch.bfloat16, torch.device("cpu"), MAX_LEN)
    many = fused_decode.MAX_TOKENS + 1
    one = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        cache = bf16.new_kv_cache(many, MAX_LEN)
        assert bf16.fused_decode.accepts(one, _meta(bf16, [0], [5], [1]), cache)
        assert not bf16.fused_decode.accepts(
            torch.zeros(many, dtype=torch.long), _meta(bf16, list(range(many)), [5] * many, [1] * many), cache
        )
        # Prefill chunks run fused too, up to MAX_TOKENS tokens in all.
        assert bf16.fused_decode.accepts(torch.zeros(9, dtype=torch.long), _meta(bf16, [0], [0], [9]), cache)
        # Rows beyond the cache it is given (a slot or a position past its end) go to the checked path.
        assert not bf16.fused_decode.accepts(one, _meta(bf16, [many], [5], [1]), cache)
        assert not bf16.fused_decode.accepts(one, _meta(bf16, [0], [5], [1]), bf16.new_kv_cache(1, 5))
        assert not fp32.fused_decode.accepts(one, _meta(fp32, [0], [5], [1]), fp32.new_kv_cache(1, MAX_LEN))
        assert not qk_norm.fused_decode.accepts(one, _meta(qk_norm, [0], [5], [1]), qk_norm.new_kv_cache(1, MAX_LEN))


@needs_fused
def test_verification_rows_get_the_bits_of_one_token_decodes(custom_model_paths: dict[str, Path]) -> None:
    """By default a row of up to 8 tokens attends token by token, so verifying drafts computes exactly what
    decoding the same tokens one step at a time computes (the GEMMs give every row the same bits at any
    batch shape): greedy bf16 output with speculation is then the plain output, not just close to it. A
    9-token row (a prefill chunk) keeps the block kernel, whose bits differ."""
    max_len = 256
    model = LlamaFamilyModel.from_pretrained(custom_model_paths["d64-g3"], torch.bfloat16, torch.device("cpu"), max_len)
    start = 200  # enough keys that the block kernel's order shows in the bits

    def run(row_lens: list[int], seed: int = 5) -> torch.Tensor:
        history = torch.randint(0, model.vocab_size, (max_len,), generator=torch.Generator().manual_seed(seed))
        cache = model.new_kv_cache(1, max_len)
        out = []
        with single_torch_thread(), torch.inference_mode():
            model(history[:start], _meta_len(model, [0], [0], [start], max_len), cache)
            pos = start
            for n in row_lens:
                out.append(model(history[pos : pos + n], _meta_len(model, [0], [pos], [n], max_len), cache).float())
                pos += n
        return torch.cat(out)

    seeds = range(5, 9)
    one_by_one = [run([1] * 9, seed) for seed in seeds]
    for seed, expected in zip(seeds, one_by_one, strict=True):
        assert torch.equal(run([4, 1, 4], seed), expected)  # verification-sized rows: the same bits
        assert torch.equal(run([8, 1], seed), expected)
    # The same rows as blocks (the rule before: any run of 2+ tokens) sum in another order, which shows in
    # the final bits of some histories (a one-ulp difference may round away by the last layer).
    lib = cpu_kernels._library()
    assert lib is not None
    default = lib.decode_forward_block_min()
    lib.decode_forward_set_block_min(2)
    try:
        pairs = zip(seeds, one_by_one, strict=True)
        assert any(not torch.equal(run([4, 1, 4], seed), expected) for seed, expected in pairs)
    finally:
        lib.decode_forward_set_block_min(default)


@needs_fused
@pytest.mark.parametrize("columns", [65536, 37])
def test_fused_activation_has_torchs_bits_for_every_gate_value(columns: int) -> None:
    """silu(gate) * up from the table of torch's own silu: every bf16 gate value (NaNs, infinities,
    subnormals included) against eager bf16 ``F.silu(g) * u``, with up values over 60 decades; 37 columns
    take the masked tail, and the column past the end is left alone."""
    lib = cpu_kernels._library()
    assert lib is not None
    table = fused_decode.silu_table()
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for _ in range(8):
        gate = every[torch.randperm(1 << 16, generator=generator)[:columns]].contiguous()
        magnitude = 10 ** torch.empty(columns).uniform_(-30, 30, generator=generator)
        up = (torch.randn(columns, generator=generator) * magnitude).to(torch.bfloat16)
        out = torch.full((columns + 1,), 7.0, dtype=torch.bfloat16)
        lib.decode_forward_silu_mul(table.data_ptr(), gate.data_ptr(), up.data_ptr(), out.data_ptr(), columns)
        expected = torch.nn.functional.silu(gate) * up
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(out[:columns]), nan)
        assert torch.equal(out[:columns][~nan].view(torch.int16), expected[~nan].view(torch.int16))
        assert out[columns].item() == 7.0


@needs_fused
@pytest.mark.parametrize("family", ["d64-g3", "odd", "mistral-window"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_pruned_last_layer_gives_the_kept_tokens_the_bits_of_the_full_forward(
    family: str, threads: int, storage: torch.dtype | None, custom_model_paths: dict[str, Path]
) -> None:
    """``keep``: the last layer finishes only the kept tokens. Their states, and every token's K/V in the
    cache, are bit for bit the full forward's, whichever attention kernel a kept token gets (a decode's item,
    a verification row's items, the last token of a 12-token chunk's block), with none kept, or all."""
    path = custom_model_paths[family] if family in CUSTOM_CONFIGS else tiny_model_path(family)
    model = LlamaFamilyModel.from_pretrained(path, torch.bfloat16, torch.device("cpu"), max_len=MAX_LEN)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.vocab_size, (PROMPT_LEN,), generator=gen) for _ in range(4)]
    tokens = torch.cat([torch.randint(0, model.vocab_size, (5,), generator=gen), prompts[3][CHUNK_START:]])
    rows = ([0, 2, 1, 3], [PROMPT_LEN] * 3 + [CHUNK_START], [1, 3, 1, CHUNK_LEN])  # 17 tokens
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            full_cache = _prefilled(model, prompts, storage)
            assert model.fused_decode.accepts(tokens, _meta(model, *rows), full_cache)
            full = model(tokens, _meta(model, *rows), full_cache)
            for keep in ([0, 3, 4, 16], [0, 1, 2, 3, 4], [], [9, 16], list(range(17))):
                cache = _prefilled(model, prompts, storage)
                kept = model(tokens, _meta(model, *rows), cache, keep=torch.tensor(keep, dtype=torch.long))
                assert kept.shape == (len(keep), model.spec.hidden_size)
                assert torch.equal(kept, full[keep]), keep
                assert torch.equal(cache.data, full_cache.data), keep
            with pytest.raises(ValueError, match="increasing"):
                model(tokens, _meta(model, *rows), _prefilled(model, prompts), keep=torch.tensor([4, 3]))
    finally:
        torch.set_num_threads(previous)


@needs_fused
@pytest.mark.skipif(not gemm.uses_amx(), reason="only the AMX tiles read compressed weights")
@pytest.mark.parametrize("family", ["d64-g3", "wide-mlp"])
def test_compressed_weights_give_the_fused_forward_the_same_bits(
    family: str, custom_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = []
    for compression in (False, True):
        monkeypatch.setattr(gemm, "compression", compression)
        outputs.append(_step(custom_model_paths[family], True, torch.bfloat16, monkeypatch))
    for plain, compressed in zip(*outputs, strict=True):
        assert torch.equal(plain, compressed)
