"""The packed bf16 GEMM (``gemm``) against fp32 matmul, its epilogue's rounding and its packed copy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from nxdserve.engine.models import cpu_kernels, gemm
from nxdserve.engine.models.linear import linear

needs_gemm = pytest.mark.skipif(not gemm.available(), reason="no AVX512-BF16 C kernels on this machine")
SMALL_X_BLOCK = 256 * 1024  # 80 rows at K = 1536: the shapes below that say "several row blocks" run several


def _set_x_block_bytes(size: int) -> None:
    lib = cpu_kernels._library()
    assert lib is not None
    lib.gemm_set_x_block_bytes(size)


@pytest.fixture
def small_x_blocks() -> Iterator[None]:
    """Row blocks of x as on a CPU with a 512 KB L2, whatever this machine's L2 (its half is the default)."""
    _set_x_block_bytes(SMALL_X_BLOCK)
    try:
        yield
    finally:
        _set_x_block_bytes(0)


def _data(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    r = torch.randn(m, n, generator=gen).bfloat16()
    return x, w, b, r


@needs_gemm
@pytest.mark.usefixtures("small_x_blocks")
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 17, 3),  # one row; a partial 16-column vector; odd K: the zero-padded last pair
        (7, 100, 77),  # fewer rows than a register tile; a partial panel
        (9, 144, 64),  # one full tile and one row
        (33, 960, 576),
        (200, 96, 1536),  # more rows than one L2 block of x (80 rows at K=1536)
    ],
)
def test_gemm_matches_fp32_matmul_to_bf16_rounding(m: int, n: int, k: int) -> None:
    x, w, b, r = _data(m, n, k, seed=m)
    with torch.inference_mode():
        out = gemm.matmul(x, w, b)
        with_res = gemm.matmul(x, w, b, r)
    assert out is not None and with_res is not None and out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float(), b.float())
    # Exact products summed in fp32: at most one bf16 rounding step from the fp32 result, nearly always none.
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-3)
    assert (out == ref.bfloat16()).float().mean().item() > 0.97
    # The residual is added to the rounded projection and rounded again, as the eager ``out + residual``.
    assert torch.equal(with_res, (out.float() + r.float()).bfloat16())


@needs_gemm
@pytest.mark.usefixtures("small_x_blocks")
@pytest.mark.parametrize(("m", "k"), [(40, 320), (300, 1536)])  # one row block; several, each stolen in turn
def test_gemm_result_does_not_depend_on_thread_count(m: int, k: int) -> None:
    """More threads than cores (7 on the 2-core CI machine) get descheduled mid-GEMM, so the others steal
    their panels: every panel must still be computed exactly once, with the same bits."""
    x, w, b, r = _data(m, 480, k, seed=1)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = gemm.matmul(x, w, b, r)
            results = []
            for count in (2, 3, 7, 7, 7):
                torch.set_num_threads(count)
                results.append(gemm.matmul(x, w, b, r))
    finally:
        torch.set_num_threads(threads)
    assert one is not None and all(many is not None and torch.equal(one, many) for many in results)


@needs_gemm
@pytest.mark.parametrize("block", [SMALL_X_BLOCK, 64 * 1024, 0])  # 80 rows at K = 1536, 32 (the least), L2 / 2
def test_row_blocks_of_x_do_not_change_the_bits(block: int) -> None:
    """x is cut in row blocks that stay in L2 while the weight panels pass (half the L2 by default): every
    block size gives each row the same bits, residual included."""
    x, w, b, r = _data(300, 200, 1536, seed=4)
    with torch.inference_mode():
        _set_x_block_bytes(1 << 30)  # one block for all 300 rows
        try:
            whole = gemm.matmul(x, w, b, r)
            _set_x_block_bytes(block)
            blocked = gemm.matmul(x, w, b, r)
        finally:
            _set_x_block_bytes(0)
    ref = F.linear(x.float(), w.float(), b.float())
    assert whole is not None and blocked is not None and torch.equal(whole, blocked)
    torch.testing.assert_close(whole.float(), ref + r.float(), rtol=2**-6, atol=2e-2)


@needs_gemm
def test_packed_copy_follows_in_place_weight_updates() -> None:
    x = torch.ones(3, 64, dtype=torch.bfloat16)
    weight = torch.zeros(50, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = gemm.matmul(x, weight)
        weight.add_(1.0)  # e.g. weights loaded again: the packed copy must not be stale
        after = gemm.matmul(x, weight)
    assert before is not None and after is not None
    assert before.abs().max().item() == 0.0
    assert torch.equal(after.float(), torch.full((3, 50), 64.0))


@needs_gemm
def test_linear_takes_the_gemm_for_2d_and_3d_inputs_and_adds_the_residual() -> None:
    x, w, b, r = _data(12, 70, 48, seed=5)
    with torch.inference_mode():
        direct = gemm.matmul(x, w, b)
        flat = linear(x, w, b)
        batched = linear(x.view(3, 4, 48), w, b)
        fused = linear(x.view(3, 4, 48), w, b, residual=r.view(3, 4, 70))
    assert direct is not None
    assert torch.equal(flat, direct) and torch.equal(batched, direct.view(3, 4, 70))
    assert torch.equal(fused, (direct.float() + r.float()).bfloat16().view(3, 4, 70))


def test_gemm_declines_what_it_does_not_cover() -> None:
    x, w, b, _ = _data(4, 32, 16, seed=2)
    with torch.inference_mode():
        assert gemm.matmul(x.float(), w.float()) is None  # fp32
        assert gemm.matmul(x.repeat(1, 2)[:, ::2], w) is None  # elements of a row not adjacent
        assert gemm.matmul(x, w[:, :8]) is None  # inner sizes differ
    trained = torch.nn.Parameter(w.clone())
    assert gemm.matmul(x, trained) is None  # requires grad: autograd must see the op
    y = linear(x, trained, b)
    assert y.requires_grad


def test_linear_without_the_gemm_takes_onednn_and_still_adds_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "enabled", False)  # as on a CPU without AVX512-BF16
    x, w, b, r = _data(6, 40, 32, seed=7)
    with torch.inference_mode():
        plain = linear(x, w, b)
        fused = linear(x, w, b, residual=r)
    assert torch.equal(plain, F.linear(x, w, b))
    assert torch.equal(fused, F.linear(x, w, b) + r)


needs_amx = pytest.mark.skipif(not gemm.uses_amx(), reason="no AMX-BF16 on this machine")


@needs_amx
@pytest.mark.usefixtures("small_x_blocks")
@pytest.mark.parametrize(("n", "k"), [(960, 576), (200, 1536)])  # one L2 block of x; several (80 rows at K=1536)
def test_amx_rows_do_not_depend_on_what_they_are_batched_with(n: int, k: int) -> None:
    """Every row goes through the tiles, a last partial tile from a padded copy: so a request's bits are the
    same alone, in a batch of 17 or of 200 (prefix caching and lossless speculation rely on it)."""
    x, w, b, r = _data(200, n, k, seed=11)
    with torch.inference_mode():
        full = gemm.matmul(x, w, b, r)
        assert full is not None
        for m in (1, 15, 16, 17, 33, 81):
            part = gemm.matmul(x[:m].contiguous(), w, b, r[:m].contiguous())
            assert part is not None and torch.equal(part, full[:m]), m
            tail = gemm.matmul(x[-m:].contiguous(), w, b, r[-m:].contiguous())
            assert tail is not None and torch.equal(tail, full[-m:]), m


@needs_amx
def test_amx_can_be_switched_off_for_the_avx512_tile() -> None:
    lib = gemm.cpu_kernels._library()
    assert lib is not None
    x, w, b, _ = _data(40, 480, 576, seed=3)
    # Terms 2^24, 1, -2^24, 1: the tiles sum them to 2, the AVX512 tile (another order within a pair) to 0.
    x_order = torch.zeros(1, 64)
    x_order[0, :4] = torch.tensor([4096.0, 1.0, 4096.0, 1.0])
    w_order = torch.zeros(48, 64)
    w_order[0, :4] = torch.tensor([4096.0, 1.0, -4096.0, 1.0])
    x_order, w_order = x_order.bfloat16(), w_order.bfloat16()
    with torch.inference_mode():
        tiles = gemm.matmul(x, w, b)
        tiles_order = gemm.matmul(x_order, w_order)
        try:
            assert lib.gemm_set_amx(0) == 0 and not gemm.uses_amx()
            avx = gemm.matmul(x, w, b)
            avx_order = gemm.matmul(x_order, w_order)
        finally:
            assert lib.gemm_set_amx(1) == 1
    assert tiles is not None and avx is not None and tiles_order is not None and avx_order is not None
    assert (tiles_order[0, 0].item(), avx_order[0, 0].item()) == (2.0, 0.0)
    # Both sum exact products in fp32 (in another order): at most a bf16 rounding step apart.
    torch.testing.assert_close(tiles.float(), avx.float(), rtol=2**-7, atol=1e-3)


def _awkward_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight whose words the compressed copy cannot all code: zeros of both signs, subnormals, huge and
    tiny magnitudes, next to ordinary Gaussian values."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    flat = w.view(-1)
    picks = torch.randperm(flat.numel(), generator=gen)[:60]
    specials = torch.tensor([0.0, -0.0, 1e-39, -3e-40, 1e-30, 300.0, -2.0**20, 5e-3])
    flat[picks] = specials.repeat(8)[:60]
    return w.bfloat16()


def _patch_count(blob: torch.Tensor, panels: int) -> int:
    at_offset = int(blob[16:24].view(torch.int64))
    return int(blob[at_offset : at_offset + 4 * (panels + 1)].view(torch.int32)[-1])


def _decode(blob: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The compressed copy's words, decoded here as the format says (``csrc/gemm.c``, "Compressed panels")."""
    panels, steps = -(-n // gemm.PANEL), k // 32
    table = blob[:16].to(torch.int32)
    at_offset, pos_offset, val_offset = (int(v) for v in blob[16:40].view(torch.int64))
    data = blob[gemm.CW_HEADER : gemm.CW_HEADER + panels * steps * 2304].view(panels, steps, 2304)
    low = data[..., :1536].reshape(panels, steps, 12, 2, 64).to(torch.int32)
    code_bytes = data[..., 1536:].reshape(panels, steps, 12, 64).to(torch.int32)
    codes = torch.stack((code_bytes & 15, code_bytes >> 4), dim=3)
    by_byte = low | (table[codes] << 8)
    words = torch.empty_like(by_byte)
    words[..., gemm._cw_byte_order()] = by_byte  # byte b holds word order[b]
    words = words.reshape(panels, -1)
    at = blob[at_offset : at_offset + 4 * (panels + 1)].view(torch.int32)
    total = int(at[-1])
    pos = blob[pos_offset : pos_offset + 4 * total].view(torch.int32).long()
    val = blob[val_offset : val_offset + 2 * total].view(torch.int16).to(torch.int32) & 0xFFFF
    for p in range(panels):
        lo, hi = int(at[p]), int(at[p + 1])
        words[p, pos[lo:hi]] = val[lo:hi]
    return words


@needs_gemm
@pytest.mark.parametrize(("n", "k"), [(100, 64), (960, 576)])
def test_compressed_copy_decodes_to_the_packed_words(n: int, k: int) -> None:
    weight = _awkward_weight(n, k, seed=n)
    with torch.inference_mode():
        blob = gemm.compress(weight)
        plain = gemm.pack(weight).view(torch.int16).reshape(-(-n // gemm.PANEL), -1).to(torch.int32) & 0xFFFF
    assert blob is not None and blob.dtype == torch.uint8
    patches = _patch_count(blob, plain.shape[0])
    assert patches > 0  # some of the subnormals and extremes above
    # 12 bits a word, 6 bytes a patch, the header, the panels' patch index and alignment
    assert blob.numel() <= 1.5 * plain.numel() + 6 * patches + 4 * (plain.shape[0] + 1) + 4 * 64
    assert torch.equal(_decode(blob, n, k), plain)
    assert gemm.compress(weight[:, :40].contiguous()) is None  # K not a multiple of 32: no compressed copy
    lib = gemm.cpu_kernels._library()
    assert lib is not None and lib.gemm_cw_header_size() == 40  # the C struct the header's bytes 0-40 fill


@needs_amx
@pytest.mark.usefixtures("small_x_blocks")
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 960, 576),  # a decode step: one row tile, a step decoded at a time
        (40, 480, 576),  # three row tiles share each decoded chunk
        (17, 200, 1536),
        (200, 96, 1536),  # several row blocks
    ],
)
def test_gemm_on_compressed_panels_gives_the_plain_panels_bits(
    m: int, n: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, _, b, r = _data(m, n, k, seed=m)
    weight = _awkward_weight(n, k, seed=m + 1)
    with torch.inference_mode():
        monkeypatch.setattr(gemm, "compression", False)
        plain = gemm.matmul(x, weight, b, r)
        monkeypatch.setattr(gemm, "compression", True)
        blob = gemm.compressed(weight)
        compressed = gemm.matmul(x, weight, b, r)
    assert blob is not None and _patch_count(blob, -(-n // gemm.PANEL)) > 0
    assert plain is not None and compressed is not None
    assert torch.equal(compressed, plain)
