/* The bf16 GEMM used by ``linear`` on CPUs with AVX512-BF16 (part of kernels.c).

   oneDNN's matmul is near the machine's peak when a weight sits in cache, but in a model every weight comes
   from DRAM once per step, and at 1-128 rows oneDNN reads it before computing rather than while: measured
   in a 30-layer cycle of SmolLM2's shapes, its batch-32 projections ran at 190-290 GFLOP/s, of ~410.
   ``gemm_bf16`` keeps each weight in panels of 48 columns stored as ``[ceil(K/2)][48][2]`` bf16 pairs
   (``gemm.pack``), so a panel is one sequential stream, and while the 8-row tiles of x pass over panel p
   they prefetch panel p + 1 into L2, each tile an equal part of it. (Before, the first tile pulled the whole
   next panel at the rate it read p: at 32 rows, four tiles a panel, one core cannot stream 55 KB in one tile's
   2.2 us, and the rest arrived late; spread, the 32-row projections took 0.86-1.02x the time in five runs of
   `benchmarks/gemm_bench.py`, the down projection gaining most.)
   The register tile is 8 rows x 48 columns (24 zmm accumulators, ``vdpbf16ps``: bf16 pairs multiplied exactly,
   summed in fp32, k in order), which gives the same bits as oneDNN's brgemm on every shape tested.

   Epilogue, as the eager layer rounds: ``out = bf16(acc + bias)``, then optionally ``bf16(out + residual)``
   (a decoder layer's down projection and its residual add in one pass over the output). */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#include <unistd.h> /* sysconf: the L2 size */

int gemm_available(void) { return 1; }

#define GM_NV 3              /* zmm column vectors per panel */
#define GM_NR (16 * GM_NV)   /* columns per panel */
#define GM_MR 8              /* rows per register tile */
#define GM_STEP_LINES (2 * GM_NR * 2 / 64) /* cache lines of a panel per k pair: 48 columns x 2 bf16 */
_Static_assert(GM_STEP_LINES == 3, "gm_tile prefetches a whole panel's step as three lines");

/* fp32 -> bf16 bits, round to nearest even (NaN stays NaN), 16 lanes: f2bf vectorised. */
static inline __m256i gm_round(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
static inline __m512 gm_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The epilogue of 16 output columns (as the eager layer rounds): out = bf16(acc + bias), then, with res,
   bf16(out + res). m masks the columns past N; bv is gm_bias16's. */
static inline __mmask16 gm_cols16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}
static inline __m512 gm_bias16(const uint16_t* bias, int64_t c, __mmask16 m) {
    return bias ? gm_widen(_mm256_maskz_loadu_epi16(m, bias + c)) : _mm512_setzero_ps();
}
static inline void gm_finish16(__m512 acc, __m512 bv, __mmask16 m, const uint16_t* res, uint16_t* out) {
    __m256i h = gm_round(_mm512_add_ps(acc, bv));
    if (res) h = gm_round(_mm512_add_ps(gm_widen(h), gm_widen(_mm256_maskz_loadu_epi16(m, res))));
    _mm256_mask_storeu_epi16(out, m, h);
}

/* One register tile: MR rows of x (row stride xs) times one panel (GM_NR columns starting at column c0),
   epilogue out = bf16(bf16(acc + bias) + res) with bias and res optional, columns >= N masked off.
   pf, pf_lines: the cache lines of the next panel this tile pulls into L2, spread over its k steps. */
#define GM_KERNEL(MR)                                                                                  \
static void gm_tile_##MR(const uint16_t* x, int64_t xs, int64_t K, const uint16_t* w, const char* pf,   \
                         int64_t pf_lines, const uint16_t* bias, const uint16_t* res, int64_t rs,      \
                         uint16_t* out, int64_t os, int64_t c0, int64_t N) {                           \
    __m512 acc[MR][GM_NV];                                                                             \
    for (int r = 0; r < MR; r++)                                                                       \
        for (int v = 0; v < GM_NV; v++) acc[r][v] = _mm512_setzero_ps();                               \
    const int64_t K2 = K / 2;                                                                          \
    /* pf_lines cache lines spread evenly over the K2 steps (Bresenham); a whole panel, a step's lines. */ \
    const int whole = pf_lines == GM_STEP_LINES * K2;                                                  \
    int64_t pf_due = 0;                                                                                \
    for (int64_t k2 = 0; k2 < K2; k2++, w += 2 * GM_NR) {                                              \
        if (whole) {                                                                                   \
            _mm_prefetch(pf, _MM_HINT_T1); _mm_prefetch(pf + 64, _MM_HINT_T1); _mm_prefetch(pf + 128, _MM_HINT_T1); \
            pf += 64 * GM_STEP_LINES;                                                                  \
        } else {                                                                                       \
            for (pf_due += pf_lines; pf_due >= K2; pf_due -= K2, pf += 64) _mm_prefetch(pf, _MM_HINT_T1); \
        }                                                                                              \
        __m512bh w0 = (__m512bh)_mm512_load_si512(w), w1 = (__m512bh)_mm512_load_si512(w + 32);        \
        __m512bh w2 = (__m512bh)_mm512_load_si512(w + 64);                                             \
        for (int r = 0; r < MR; r++) {                                                                 \
            int32_t xv; memcpy(&xv, x + r * xs + 2 * k2, 4);                                           \
            __m512bh b = (__m512bh)_mm512_set1_epi32(xv);                                              \
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);                                            \
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);                                            \
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, w2);                                            \
        }                                                                                              \
    }                                                                                                  \
    if (K & 1) { /* the last, odd k: its pair's second half is zero in the packed weight */            \
        __m512bh w0 = (__m512bh)_mm512_load_si512(w), w1 = (__m512bh)_mm512_load_si512(w + 32);        \
        __m512bh w2 = (__m512bh)_mm512_load_si512(w + 64);                                             \
        for (int r = 0; r < MR; r++) {                                                                 \
            __m512bh b = (__m512bh)_mm512_set1_epi32((int32_t)x[r * xs + K - 1]);                      \
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);                                            \
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);                                            \
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, w2);                                            \
        }                                                                                              \
    }                                                                                                  \
    for (int v = 0; v < GM_NV; v++) {                                                                  \
        int64_t c = c0 + 16 * v;                                                                       \
        if (c >= N) break;                                                                             \
        __mmask16 m = gm_cols16(N - c);                                                                \
        __m512 bv = gm_bias16(bias, c, m);                                                             \
        for (int r = 0; r < MR; r++) gm_finish16(acc[r][v], bv, m, res ? res + r * rs + c : NULL, out + r * os + c); \
    }                                                                                                  \
}
GM_KERNEL(1) GM_KERNEL(2) GM_KERNEL(3) GM_KERNEL(4) GM_KERNEL(5) GM_KERNEL(6) GM_KERNEL(7) GM_KERNEL(8)

/* Rows [b0, b1) of x against one panel w (columns 48p ..): 8-row register tiles, which between them pull
   the panel ``next`` into L2 (NULL: none), tile t its t-th equal part. */
static void gm_panel(const uint16_t* x, int64_t b0, int64_t b1, int64_t K, int64_t xs, const uint16_t* w,
                     const uint16_t* next, int64_t p, const uint16_t* bias, const uint16_t* res, int64_t rs,
                     int64_t N, uint16_t* out, int64_t os) {
    const int64_t lines = ((K + 1) / 2) * GM_STEP_LINES, tiles = (b1 - b0 + GM_MR - 1) / GM_MR;
    for (int64_t m0 = b0, t = 0; m0 < b1; m0 += GM_MR, t++) {
        const uint16_t* xr = x + m0 * xs;
        const uint16_t* rr = res ? res + m0 * rs : NULL;
        uint16_t* o = out + m0 * os;
        const int64_t l0 = lines * t / tiles, l1 = next ? lines * (t + 1) / tiles : l0;
        const char* pf = next ? (const char*)next + 64 * l0 : NULL;
        const int64_t n = l1 - l0;
        switch (b1 - m0 < GM_MR ? b1 - m0 : GM_MR) {
            case 1: gm_tile_1(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
            case 2: gm_tile_2(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
            case 3: gm_tile_3(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
            case 4: gm_tile_4(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
            case 5: gm_tile_5(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
            case 6: gm_tile_6(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
            case 7: gm_tile_7(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
            default: gm_tile_8(xr, xs, K, w, pf, n, bias, rr, rs, o, os, p * GM_NR, N); break;
        }
    }
}

/* Compressed panels (``gemm.compress``): the packed panels' bf16 words in 12 bits each, losslessly. A word's
   low byte (the exponent's lowest bit and the 7 mantissa bits) is kept as it is; its high byte (sign and the
   exponent's 7 upper bits) takes one of 16 values in almost every weight (trained weights span few
   exponents), so it is stored as a 4-bit code into the matrix's table of its 16 most common high bytes. The
   few words outside the table (the largest and smallest magnitudes, zeros: 0.023% on SmolLM2) are patched in
   after the decode. A decode step streams 3/4 of the plain bytes from memory, which is what bounds it; the
   words a GEMM sees are the plain panel's, bit for bit, so the sums and outputs are unchanged.
   Layout, a uint8 blob: a 64-byte header (table[16], then int64 offsets of patch_at, patch_pos, patch_val),
   then panel after panel, each K/32 steps of GM_CW_STEP bytes: 16 k pairs x 48 columns = 1536 words as 1536
   low bytes then 768 code bytes; then the patches: patch_at (int32, P + 1: panel p's are [patch_at[p],
   patch_at[p + 1])), patch_pos (uint32, the word's index in the plain panel), patch_val (uint16). Within a
   step, 128 words at a time: codes byte b holds word group A's code in its low nibble and group B's in its
   high one, and the low bytes are in the order that _mm512_unpack{lo,hi}_epi8 interleave back. */
#define GM_AMX_STEP_PAIRS 16                         /* k pairs per tile step */
#define GM_CW_WORDS (GM_AMX_STEP_PAIRS * 2 * GM_NR) /* plain words of a step: 1536 */
#define GM_CW_STEP (GM_CW_WORDS + GM_CW_WORDS / 2)   /* its compressed bytes: 2304 */
_Static_assert(GM_CW_STEP % 64 == 0, "compressed steps stay cache-line aligned");

typedef struct {
    uint8_t table[16];
    int64_t patch_at, patch_pos, patch_val;
} gm_cw_header;

/* One step: GM_CW_STEP bytes at src -> GM_CW_WORDS plain words at dst (64-byte aligned). */
static inline void gm_cw_step(const uint8_t* src, __m512i table, uint16_t* dst) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < GM_CW_WORDS / 128; i++) {
        const __m512i c = _mm512_load_si512(src + GM_CW_WORDS + 64 * i);
        const __m512i ha = _mm512_shuffle_epi8(table, _mm512_and_si512(c, nib));
        const __m512i hb = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(c, 4), nib));
        const __m512i la = _mm512_load_si512(src + 128 * i), lb = _mm512_load_si512(src + 128 * i + 64);
        _mm512_store_si512(dst + 128 * i, _mm512_unpacklo_epi8(la, ha));
        _mm512_store_si512(dst + 128 * i + 32, _mm512_unpackhi_epi8(la, ha));
        _mm512_store_si512(dst + 128 * i + 64, _mm512_unpacklo_epi8(lb, hb));
        _mm512_store_si512(dst + 128 * i + 96, _mm512_unpackhi_epi8(lb, hb));
    }
}

/* This thread's buffer of decoded steps (at least ``steps``), NULL if it cannot be had. */
static __thread uint16_t* gm_cw_buf;
static __thread int64_t gm_cw_cap;
static uint16_t* gm_cw_scratch(int64_t steps) {
    if (gm_cw_cap < steps) {
        free(gm_cw_buf);
        gm_cw_buf = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * GM_CW_WORDS * steps);
        gm_cw_cap = gm_cw_buf ? steps : 0;
    }
    return gm_cw_buf;
}

/* The header's size, for the Python side's check of its layout (table at 0, the three offsets at 16, 24, 32). */
int gemm_cw_header_size(void) { return (int)sizeof(gm_cw_header); }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
extern long syscall(long number, ...); /* unistd.h declares it only with _GNU_SOURCE */

/* AMX (Intel since Sapphire Rapids): where the CPU has it, every GEMM whose K is a multiple of 32 runs on the
   tile unit, ~3-7x the AVX512-BF16 tile above on a 2-core Granite Rapids VM (32-170 rows). The packed panel is
   already AMX's B layout: rows of k pairs, 64-byte column groups, at a 192-byte stride. Every row of such a
   GEMM, whatever M is, goes through the tiles (a last tile of fewer than 16 rows reads a copy padded to 16),
   so a row's bits do not depend on what it is batched with. Tiles: C 0-2 (16 x 16 fp32), A 3, B 4-6. */
#define GM_AMX 1
#define GM_AMX_ROWS 16
#define GM_AMX_K 32 /* bf16 values of k per tile step (16 pairs) */
#define GM_AMX_KC 8 /* tile steps per K chunk in gm_panel_amx: 8 x 3 KB of the panel */
static int gm_amx_on = -1; /* -1: not asked yet; set by gemm_amx() before any GEMM runs */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) gm_tilecfg;

/* Whether the CPU has AMX-BF16 and the kernel lets this process use its tile registers (the permission is
   process-wide; oneDNN asks for it the same way). */
static int gm_amx_request(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return 0;
    return syscall(158 /* arch_prctl */, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* The tile configuration is per thread, and oneDNN loads its own on the same OpenMP threads: loaded at the
   start of every GEMM a thread takes part in. */
static inline void gm_amx_config(void) {
    gm_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) { cfg.colsb[t] = 64; cfg.rows[t] = GM_AMX_ROWS; }
    _tile_loadconfig(&cfg);
}

/* This thread's copy of x's last M % 16 rows, padded to 16 rows of K (NULL when M is a multiple of 16). */
static __thread uint16_t* gm_tail_buf;
static __thread int64_t gm_tail_cap;
static const uint16_t* gm_amx_tail(const uint16_t* x, int64_t M, int64_t K, int64_t xs) {
    const int64_t r = M % GM_AMX_ROWS;
    if (!r) return NULL;
    if (gm_tail_cap < GM_AMX_ROWS * K) {
        free(gm_tail_buf);
        gm_tail_buf = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * GM_AMX_ROWS * K);
        if (!gm_tail_buf) { gm_tail_cap = 0; return NULL; }
        memset(gm_tail_buf, 0, sizeof(uint16_t) * GM_AMX_ROWS * K);
        gm_tail_cap = GM_AMX_ROWS * K;
    }
    for (int64_t i = 0; i < r; i++) memcpy(gm_tail_buf + i * K, x + (M - r + i) * xs, sizeof(uint16_t) * K);
    return gm_tail_buf;
}

/* This thread's fp32 partial sums of ``tiles`` row tiles (3 C tiles each) between K chunks of gm_panel_amx. */
static __thread float* gm_acc_buf;
static __thread int64_t gm_acc_cap;
static float* gm_amx_acc(int64_t tiles) {
    const int64_t need = tiles * GM_NV * GM_AMX_ROWS * 16;
    if (gm_acc_cap < need) {
        free(gm_acc_buf);
        gm_acc_buf = (float*)aligned_alloc(64, sizeof(float) * need);
        gm_acc_cap = gm_acc_buf ? need : 0;
    }
    return gm_acc_buf;
}

/* gm_panel on the tiles: rows [b0, b1) of x against panel p, 16 rows a tile; a last tile of fewer rows reads
   ``tail`` (gm_amx_tail) instead of x. The next panel is pulled into L2 as in gm_panel, paced over all the
   tile steps. With several row tiles, K goes in chunks of GM_AMX_KC steps: every row tile passes over one
   chunk of the panel (24 KB, held in L1) before the next chunk, its three C tiles saved in fp32 between
   chunks. Without chunks each row tile re-read the whole 55 KB panel from L2, whose bandwidth, not the
   tiles, bounded a prefill. Each C tile still sums k in order, so the bits are the same either way. */
static void gm_panel_amx(const uint16_t* x, int64_t b0, int64_t b1, int64_t K, int64_t xs, const uint16_t* tail,
                         const uint16_t* w, const uint8_t* cw, const uint16_t* next, int64_t p, const uint16_t* bias,
                         const uint16_t* res, int64_t rs, int64_t N, uint16_t* out, int64_t os) {
    float c[GM_AMX_ROWS * GM_NR] __attribute__((aligned(64)));
    const int64_t KB = K / GM_AMX_K;
    const int64_t tiles = (b1 - b0 + GM_AMX_ROWS - 1) / GM_AMX_ROWS, steps = tiles * KB;
    float* acc = tiles > 1 && KB > GM_AMX_KC ? gm_amx_acc(tiles) : NULL;
    const int64_t chunks = acc ? (KB + GM_AMX_KC - 1) / GM_AMX_KC : 1;
    /* Compressed: the first row tile decodes each step of a chunk into this thread's buffer (one step, reused,
       when there is one row tile), the others read it there; the next panel's compressed bytes are prefetched. */
    const uint8_t* src = cw ? cw + 64 + p * KB * GM_CW_STEP : NULL;
    uint16_t* dec = cw ? gm_cw_scratch(tiles > 1 ? (KB + chunks - 1) / chunks : 1) : NULL;
    if (cw && !dec) { src = NULL; cw = NULL; }
    const int64_t lines = !next ? 0 : cw ? KB * (GM_CW_STEP / 64) : (K / 2) * GM_STEP_LINES;
    const char* pf = !next ? NULL : cw ? (const char*)(src + KB * GM_CW_STEP) : (const char*)next;
    int64_t due = 0;
    __m512i table = _mm512_setzero_si512();
    const uint32_t* ppos = NULL;
    const uint16_t* pval = NULL;
    int32_t q = 0, q1 = 0;
    if (cw) {
        const gm_cw_header* hd = (const gm_cw_header*)cw;
        const int32_t* at = (const int32_t*)(cw + hd->patch_at);
        table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)hd->table));
        ppos = (const uint32_t*)(cw + hd->patch_pos);
        pval = (const uint16_t*)(cw + hd->patch_val);
        q = at[p];
        q1 = at[p + 1];
    }
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t k0 = KB * ch / chunks, k1 = KB * (ch + 1) / chunks;
        for (int64_t m0 = b0, t = 0; m0 < b1; m0 += GM_AMX_ROWS, t++) {
            const int64_t rows = b1 - m0 < GM_AMX_ROWS ? b1 - m0 : GM_AMX_ROWS;
            const uint16_t* a = rows == GM_AMX_ROWS ? x + m0 * xs : tail;
            const int64_t as = 2 * (rows == GM_AMX_ROWS ? xs : K);
            float* part = acc ? acc + t * GM_NV * GM_AMX_ROWS * 16 : NULL;
            if (ch == 0) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2);
            } else {
                _tile_loadd(0, part, 64);
                _tile_loadd(1, part + GM_AMX_ROWS * 16, 64);
                _tile_loadd(2, part + 2 * GM_AMX_ROWS * 16, 64);
            }
            const uint16_t* wk = w + k0 * GM_AMX_K * GM_NR;
            for (int64_t kb = k0; kb < k1; kb++, wk += GM_AMX_K * GM_NR) {
                for (due += lines; due >= steps; due -= steps, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
                if (cw) {
                    uint16_t* d = dec + (tiles > 1 ? kb - k0 : 0) * GM_CW_WORDS;
                    if (t == 0) {
                        gm_cw_step(src + kb * GM_CW_STEP, table, d);
                        const uint32_t base = (uint32_t)kb * GM_CW_WORDS;
                        for (; q < q1 && ppos[q] < base + GM_CW_WORDS; q++) d[ppos[q] - base] = pval[q];
                    }
                    wk = d;
                }
                _tile_loadd(3, a + kb * GM_AMX_K, as);
                _tile_loadd(4, wk, 4 * GM_NR);
                _tile_loadd(5, wk + 32, 4 * GM_NR);
                _tile_loadd(6, wk + 64, 4 * GM_NR);
                _tile_dpbf16ps(0, 3, 4);
                _tile_dpbf16ps(1, 3, 5);
                _tile_dpbf16ps(2, 3, 6);
            }
            if (ch + 1 < chunks) {
                _tile_stored(0, part, 64);
                _tile_stored(1, part + GM_AMX_ROWS * 16, 64);
                _tile_stored(2, part + 2 * GM_AMX_ROWS * 16, 64);
                continue;
            }
            _tile_stored(0, c, 4 * GM_NR);
            _tile_stored(1, c + 16, 4 * GM_NR);
            _tile_stored(2, c + 32, 4 * GM_NR);
            for (int v = 0; v < GM_NV; v++) {
                const int64_t col = p * GM_NR + 16 * v;
                if (col >= N) break;
                const __mmask16 m = gm_cols16(N - col);
                const __m512 bv = gm_bias16(bias, col, m);
                for (int64_t r = 0; r < rows; r++)
                    gm_finish16(_mm512_load_ps(c + r * GM_NR + 16 * v), bv, m,
                                res ? res + (m0 + r) * rs + col : NULL, out + (m0 + r) * os + col);
            }
        }
    }
}

static inline int gm_use_amx(int64_t K) { return gm_amx_on > 0 && K % GM_AMX_K == 0; }
#else
static const int gm_amx_on = 0;
static inline int gm_use_amx(int64_t K) { (void)K; return 0; }
#endif


/* Pulls the first panel of a weight, plain (cw NULL) or compressed, into L2. */
static inline void gm_prefetch_panel(const uint16_t* wp, const uint8_t* cw, int64_t K, int64_t p) {
    if (!gm_use_amx(K)) cw = NULL; /* only the tiles read compressed panels */
    const int64_t bytes = cw ? (K / (2 * GM_AMX_STEP_PAIRS)) * GM_CW_STEP : ((K + 1) / 2) * 2 * GM_NR * 2;
    const char* c = cw ? (const char*)(cw + 64 + p * bytes) : (const char*)wp + p * bytes;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

/* Asks for AMX once (call before the first GEMM); whether GEMMs use it. */
int gemm_amx(void) {
#ifdef GM_AMX
    if (gm_amx_on < 0) gm_amx_on = gm_amx_request();
#endif
    return gm_amx_on > 0;
}

/* AMX off (0) or back on where available (1), for A/B measurements and tests; returns whether it is on. */
int gemm_set_amx(int on) {
#ifdef GM_AMX
    gm_amx_on = on ? gm_amx_request() : 0;
#else
    (void)on;
#endif
    return gm_amx_on > 0;
}

/* Bytes of x a row block holds: half of this core's L2 (the panels stream through the other half), 256 KB
   where the OS does not report it. A fixed 256 KB split a 2 x 70-token step's down projection (K = 1536) in
   two blocks on a 2 MB L2, each re-reading every panel: half the L2 made that GEMM 0.8-0.85x and a
   288-row layer's GEMMs 0.86x. gemm_set_x_block_bytes (tests: several blocks on any machine) overrides it. */
static int64_t gm_x_block_set, gm_x_block_l2;
void gemm_set_x_block_bytes(int64_t bytes) { __atomic_store_n(&gm_x_block_set, bytes, __ATOMIC_RELAXED); }
static inline int64_t gm_x_block_bytes(void) {
    const int64_t set = __atomic_load_n(&gm_x_block_set, __ATOMIC_RELAXED);
    if (set > 0) return set;
    int64_t half = __atomic_load_n(&gm_x_block_l2, __ATOMIC_RELAXED);
    if (!half) { /* the same value whichever thread asks first */
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        half = l2 >= 512 * 1024 ? l2 / 2 : 256 * 1024;
        __atomic_store_n(&gm_x_block_l2, half, __ATOMIC_RELAXED);
    }
    return half;
}

/* Rows of x per block that stays in L2 while the panels pass over it; whole AMX tiles. */
static inline int64_t gm_row_block(int64_t K) {
    const int64_t unit = gm_use_amx(K) ? 16 : GM_MR;
    int64_t mb = (gm_x_block_bytes() / (2 * K)) / unit * unit;
    return mb < 4 * GM_MR ? 4 * GM_MR : mb;
}

/* Rows [0, M) of x against panels [p0, p1) of w: out columns 48 * p0 .. min(48 * p1, N), row block by row
   block. One thread's static share of a GEMM too big for work stealing (a long prefill). */
static void gm_panels(const uint16_t* x, int64_t M, int64_t K, int64_t xs, const uint16_t* wp, const uint8_t* cw,
                      int64_t p0, int64_t p1, const uint16_t* bias, const uint16_t* res, int64_t rs, int64_t N,
                      uint16_t* out, int64_t os) {
    const int64_t panel = ((K + 1) / 2) * 2 * GM_NR, mb = gm_row_block(K);
    const int amx = gm_use_amx(K) && p0 < p1;
    const uint16_t* tail = NULL;
#ifdef GM_AMX
    if (amx) { gm_amx_config(); tail = gm_amx_tail(x, M, K, xs); }
#endif
    for (int64_t b0 = 0; b0 < M; b0 += mb) {
        int64_t b1 = b0 + mb < M ? b0 + mb : M;
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t* w = wp + p * panel;
            const uint16_t* next = p + 1 < p1 ? w + panel : NULL;
#ifdef GM_AMX
            if (amx) { gm_panel_amx(x, b0, b1, K, xs, tail, w, cw, next, p, bias, res, rs, N, out, os); continue; }
#endif
            gm_panel(x, b0, b1, K, xs, w, next, p, bias, res, rs, N, out, os);
        }
    }
    (void)tail;
}

/* Share [p0, p1) of P panels for thread tid of nt. */
static inline void gm_share(int64_t P, int tid, int nt, int64_t* p0, int64_t* p1) {
    *p0 = P * tid / nt;
    *p1 = P * (tid + 1) / nt;
}

/* Work stealing over panels. On a shared machine (the server's event loop, a client, other processes) the
   OS takes a core from one of the GEMM threads now and then; with a static split the other thread then
   waits at the next barrier for the whole time slice. Here each thread owns a static run of panels, which it
   takes from the front, one panel per claim, so its weight stream stays sequential and prefetched; a thread
   whose run is done takes the other runs' panels from their back ends. A run is one 64-bit word, next << 32
   | end, on its own cache line, claimed by compare-and-swap (uncontended until the end of a GEMM).
   An x of several row blocks (a prefill) has a set of runs per row block, taken block after block: the
   same static runs as a static split would give, so a thread's panels stay in its L2 from one block to the
   next unless they are stolen, and no block waits for another. */
typedef struct { uint64_t run; char pad[56]; } gm_run;

/* Row blocks of an x of M rows (at least one: the runs of an empty x are set up and find nothing). */
static inline int64_t gm_blocks(int64_t M, int64_t K) {
    const int64_t mb = gm_row_block(K);
    return M <= mb ? 1 : (M + mb - 1) / mb;
}

/* Runs for every row block of x (M rows) against P panels: runs[b * nt + t] is thread t's in block b. */
static inline void gm_runs_init(gm_run* runs, int64_t M, int64_t K, int64_t P, int nt) {
    const int64_t nb = gm_blocks(M, K);
    for (int64_t b = 0; b < nb; b++)
        for (int t = 0; t < nt; t++) {
            int64_t p0, p1;
            gm_share(P, t, nt, &p0, &p1);
            runs[b * nt + t].run = ((uint64_t)p0 << 32) | (uint64_t)p1;
        }
}

static inline int gm_claim(gm_run* r, int back, int64_t* p, int64_t* end) {
    uint64_t v = __atomic_load_n(&r->run, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t n = v >> 32, e = v & 0xffffffffu;
        if (n >= e) return 0;
        uint64_t want = back ? (n << 32) | (e - 1) : ((n + 1) << 32) | e;
        if (__atomic_compare_exchange_n(&r->run, &v, want, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *p = back ? (int64_t)e - 1 : (int64_t)n;
            *end = (int64_t)e;
            return 1;
        }
    }
}

/* Work stealing on (1) or off (0: every GEMM splits statically), for A/B measurements and tests. */
static int gm_stealing = 1;
void gemm_set_work_stealing(int on) { gm_stealing = on; }

/* Thread tid's part of x (M rows) @ w^T with runs set by gm_runs_init for x's row blocks and w's panels. */
static void gm_panels_steal(const uint16_t* x, int64_t M, int64_t K, int64_t xs, const uint16_t* wp,
                            const uint8_t* cw, gm_run* runs, int tid, int nt, const uint16_t* bias,
                            const uint16_t* res, int64_t rs, int64_t N, uint16_t* out, int64_t os) {
    const int64_t panel = ((K + 1) / 2) * 2 * GM_NR, mb = gm_row_block(K);
    int64_t p, end;
#ifdef GM_AMX
    if (gm_use_amx(K)) {
        gm_amx_config();
        const uint16_t* tail = gm_amx_tail(x, M, K, xs);
        for (int64_t b0 = 0; b0 < M; b0 += mb, runs += nt) {
            const int64_t b1 = b0 + mb < M ? b0 + mb : M;
            while (gm_claim(&runs[tid], 0, &p, &end)) {
                const uint16_t* w = wp + p * panel;
                gm_panel_amx(x, b0, b1, K, xs, tail, w, cw, p + 1 < end ? w + panel : NULL, p, bias, res, rs, N,
                             out, os);
            }
            for (int u = 1; u < nt; u++)
                while (gm_claim(&runs[(tid + u) % nt], 1, &p, &end))
                    gm_panel_amx(x, b0, b1, K, xs, tail, wp + p * panel, cw, NULL, p, bias, res, rs, N, out, os);
        }
        return;
    }
#endif
    for (int64_t b0 = 0; b0 < M; b0 += mb, runs += nt) {
        const int64_t b1 = b0 + mb < M ? b0 + mb : M;
        while (gm_claim(&runs[tid], 0, &p, &end)) {
            const uint16_t* w = wp + p * panel;
            gm_panel(x, b0, b1, K, xs, w, p + 1 < end ? w + panel : NULL, p, bias, res, rs, N, out, os);
        }
        for (int u = 1; u < nt; u++)
            while (gm_claim(&runs[(tid + u) % nt], 1, &p, &end))
                gm_panel(x, b0, b1, K, xs, wp + p * panel, NULL, p, bias, res, rs, N, out, os);
    }
}

/* out (M, N) = bf16(x (M, K) @ w^T + bias) [+ res, rounded again], w packed by panels (``gemm.pack``):
   panel p holds columns 48p..48p+47 as [ceil(K/2)][48][2] bf16 pairs, zero-padded. Each thread takes
   a run of whole panels in each row block of x (and steals from the others' runs when done). out
   may be res (an in-place residual add). cw: the same panels compressed (``gemm.compress``) or NULL; the
   tiles read those, the AVX512 tile the plain ones. */
static void gm_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t xs, const uint16_t* wp,
                         const uint8_t* cw, const uint16_t* bias, const uint16_t* res, int64_t rs, int64_t N,
                         uint16_t* out, int64_t os, int nthreads) {
    const int64_t P = (N + GM_NR - 1) / GM_NR;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (nt > P) nt = (int)P;
    gm_run* runs = NULL;
    if (nt > 1 && gm_stealing) {
        runs = (gm_run*)aligned_alloc(64, sizeof(gm_run) * nt * gm_blocks(M, K));
        if (runs) gm_runs_init(runs, M, K, P, nt);
    }
    _Pragma("omp parallel num_threads(nt)")
    {
        int tid = omp_get_thread_num();
        if (runs) {
            gm_panels_steal(x, M, K, xs, wp, cw, runs, tid, nt, bias, res, rs, N, out, os);
        } else {
            int64_t p0, p1;
            gm_share(P, tid, omp_get_num_threads(), &p0, &p1);
            gm_panels(x, M, K, xs, wp, cw, p0, p1, bias, res, rs, N, out, os);
        }
    }
    free(runs);
}

void gemm_bf16(const nxd_gemm_args* a) {
    gm_gemm_bf16(a->x, a->M, a->K, a->xs, a->wp, a->cw, a->bias, a->res, a->rs, a->N, a->out, a->os, a->nthreads);
}
#else
int gemm_available(void) { return 0; }
int gemm_amx(void) { return 0; }
int gemm_set_amx(int on) { (void)on; return 0; }
#endif
