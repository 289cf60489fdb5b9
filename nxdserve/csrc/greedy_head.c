/* The exact greedy LM head (part of kernels.c) (``greedy_head``): the argmax of ``bf16(x @ W.T)`` without the logits.

   The LM head is ~11% of a 32-row decode step on the CPU (49152 x 576 at the bf16 peak). A greedy row needs
   only the index of its largest logit. So the head runs first in int8 (``vpdpbusd``: twice the bf16 rate,
   half the bytes), with a proven bound on how far each int8 logit can be from the bf16 one. Only the columns
   whose bound reaches the row's best lower bound are computed again in bf16, by the very register tile the
   full head uses (``gm_tile_1``, or the AMX tiles where the GEMMs run on them), which gives the same bits. The
   index returned is the one the full head's logits give to ``argmax`` (first maximum).

   Where the bound comes from, for a row x and a column w (K values, bf16):
     x is split into a few calibrated outlier channels S (kept in bf16: the final hidden state has a handful of
     channels 10-40x larger than the rest, which would set the int8 scale of every other channel) and the rest
     R. On R, x ~ s_x q (q = round(x / s_x), |q| <= 127, stored as q + 128 for the unsigned operand) and
     w ~ s_w c (per-column scale). Then
       |x_R . w_R - s_x s_w (q . c)| <= |x_R . (w_R - s_w c)| + |(x_R - s_x q) . s_w c|
     and each term is bounded by the smaller of its max-norm form (s_w ||x_R||_1 / 2, s_x s_w ||c||_1 / 2)
     and its Cauchy-Schwarz form (||x_R||_2 ||w_R - s_w c||_2, ||x_R - s_x q||_2 s_w ||c||_2), all norms
     times 1 + 2^-8 for the roundings of the scales, the norms and the fp32 products. The S part is summed in
     fp32 from exact bf16 products, and the full head's own fp32 sum differs from the real dot product by at most
     ~K 2^-24 sum |x_k w_k| <= K 2^-24 ||x||_2 ||w||_2; both are covered by C ||w||_2 with
     C = (K + |S| + 8) 2^-23 ||x||_2; 2^-14 |approx| more covers the roundings of approx, lo and hi
     themselves. So each column's bf16 logit before rounding lies in [lo, hi] =
     approx -/+ (term 1 + term 2 + C ||w||_2 + 2^-14 |approx|).
     A column can hold the row's maximum after rounding to bf16 only if hi >= L - 2^-6 |L| - 2^-90, where
     L is the largest lo of the row: bf16 keeps 8 bits, so two values more than 2^-7 of their size apart
     round apart. Every other column is dropped without its bf16 dot product.

   Rows with a non-finite value get -1 (the caller takes the full head). */

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <float.h>
int greedy_head_available(void) { return 1; }

#define GH_MR 8 /* rows per int8 register tile */

/* One thread's candidate list for one row: column indices and their upper bounds, in column order. */
typedef struct { int32_t* idx; float* hi; int64_t n; float best_lo; } gh_list;
/* Per column (greedy_head.py), slack included: scale s_w; s_w B (B = ||c||_1 / 2); s_w ||c||_2;
   ||w_R - s_w c||_2; ||w||_2; sum of c. */
typedef struct { const float *sw, *swb, *swc2, *dw, *l2; const int32_t* csum; } gh_cols;
/* Per row, slack included: s_x; A = ||x_R||_1 / 2; ||x_R||_2; ||x_R - s_x q||_2; C (the fp32 sums). */
typedef struct { float *sx, *a, *x2, *dx, *c; } gh_rows;

/* acc[r][v] = OP(acc[r][v], 4 bytes of x's row r at step k broadcast, the panel's vector v at step k) for
   k < steps: the register tile's loop, for int8 quads (vpdpbusd) and bf16 pairs (vdpbf16ps) alike. A panel
   step is 48 columns x 4 bytes; x rows are x_s elements apart. */
#define GH_STEPS(MR, VT, acc, steps, w, x, x_s, OP, PF)                                                \
    for (int64_t k = 0; k < (steps); k++, w += 192 / sizeof(*(w))) {                                   \
        PF;                                                                                            \
        const VT w0 = (VT)_mm512_load_si512(w), w1 = (VT)_mm512_load_si512((const char*)(w) + 64);     \
        const VT w2 = (VT)_mm512_load_si512((const char*)(w) + 128);                                   \
        for (int r = 0; r < MR; r++) {                                                                 \
            int32_t xv; memcpy(&xv, (const char*)((x) + r * (x_s)) + 4 * k, 4);                        \
            const VT b = (VT)_mm512_set1_epi32(xv);                                                    \
            acc[r][0] = OP(acc[r][0], b, w0);                                                          \
            acc[r][1] = OP(acc[r][1], b, w1);                                                          \
            acc[r][2] = OP(acc[r][2], b, w2);                                                          \
        }                                                                                              \
    }

/* The three phases of a tile are separate functions, each with its own 24 accumulators in registers (in one
   function GCC kept them in memory). f (MR x 48 fp32, 64-byte aligned) carries the sums between them. */
#define GH_KERNEL(MR)                                                                                  \
static __attribute__((noinline)) void gh_int8_##MR(const uint8_t* xq, int64_t xq_s, int64_t K4,          \
        const int8_t* wq, const char* pf, int64_t pf_lines, const int32_t* col_sum, const float* col_sw, \
        const float* row_sx, float* f) {                                                               \
    __v16si acc[MR][3]; /* the builtin's own type: with __m512i GCC 12 keeps the array in memory */  \
    for (int r = 0; r < MR; r++)                                                                       \
        for (int v = 0; v < 3; v++) acc[r][v] = (__v16si)_mm512_setzero_si512();                       \
    int64_t pf_due = 0; /* pf_lines of the next panel spread over the K4 steps, as gm_tile does */      \
    GH_STEPS(MR, __v16si, acc, K4, wq, xq, xq_s, __builtin_ia32_vpdpbusd_v16si,                        \
             for (pf_due += pf_lines; pf_due >= K4; pf_due -= K4, pf += 64) _mm_prefetch(pf, _MM_HINT_T1)) \
    for (int v = 0; v < 3; v++) {                                                                      \
        /* q was stored as q + 128: take 128 x the column's sum of c back out. */                     \
        __m512i off = _mm512_slli_epi32(_mm512_load_si512(col_sum + 16 * v), 7);                       \
        __m512 sw = _mm512_load_ps(col_sw + 16 * v);                                                   \
        for (int r = 0; r < MR; r++) {                                                                 \
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)acc[r][v], off));          \
            _mm512_store_ps(f + r * 48 + 16 * v, _mm512_mul_ps(sum, _mm512_mul_ps(_mm512_set1_ps(row_sx[r]), sw))); \
        }                                                                                              \
    }                                                                                                  \
}                                                                                                      \
static __attribute__((noinline)) void gh_bf16_##MR(const uint16_t* xs, int64_t xs_s, int64_t S2,        \
                                                   const uint16_t* ws, float* f) {                     \
    __m512 acc[MR][3];                                                                                 \
    for (int r = 0; r < MR; r++)                                                                       \
        for (int v = 0; v < 3; v++) acc[r][v] = _mm512_load_ps(f + r * 48 + 16 * v);                  \
    GH_STEPS(MR, __m512bh, acc, S2, ws, xs, xs_s, _mm512_dpbf16_ps, (void)0)                           \
    for (int r = 0; r < MR; r++)                                                                       \
        for (int v = 0; v < 3; v++) _mm512_store_ps(f + r * 48 + 16 * v, acc[r][v]);                   \
}                                                                                                      \
/* Rows [m0, m0 + MR) of the quantized x (u8, row stride xq_s) against int8 panel p (K4 quads) and bf16 \
   panel of the S channels (S2 pairs): approximations, bounds, candidates appended to lists[r]. */     \
static void gh_tile_##MR(const uint8_t* xq, int64_t xq_s, const uint16_t* xs, int64_t xs_s, int64_t K4,  \
                         int64_t S2, const int8_t* wq, const char* pf, int64_t pf_lines, const uint16_t* ws, \
                         const gh_cols* cols, const gh_rows* rows, int64_t c0, int64_t N, gh_list* lists) { \
    float f[MR * 48] __attribute__((aligned(64)));                                                     \
    gh_int8_##MR(xq, xq_s, K4, wq, pf, pf_lines, cols->csum + c0, cols->sw + c0, rows->sx, f);         \
    if (S2) gh_bf16_##MR(xs, xs_s, S2, ws, f);                                                         \
    for (int r = 0; r < MR; r++) {                                                                     \
        gh_list* ls = lists + r;                                                                       \
        const float L = ls->best_lo, tau = L - ldexpf(fabsf(L), -6) - 0x1p-90f;                        \
        __m512 lo_max = _mm512_set1_ps(-FLT_MAX);                                                      \
        for (int v = 0; v < 3; v++) {                                                                  \
            const int64_t c = c0 + 16 * v;                                                             \
            if (c >= N) break;                                                                         \
            const __mmask16 valid = N - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - c)) - 1); \
            const __m512 fv = _mm512_load_ps(f + r * 48 + 16 * v);                                     \
            /* Each term: the smaller of its max-norm and its Cauchy-Schwarz form. */                   \
            const __m512 t1 = _mm512_min_ps(                                                           \
                _mm512_mul_ps(_mm512_load_ps(cols->sw + c), _mm512_set1_ps(rows->a[r])),               \
                _mm512_mul_ps(_mm512_load_ps(cols->dw + c), _mm512_set1_ps(rows->x2[r])));             \
            const __m512 t2 = _mm512_min_ps(                                                           \
                _mm512_mul_ps(_mm512_load_ps(cols->swb + c), _mm512_set1_ps(rows->sx[r])),             \
                _mm512_mul_ps(_mm512_load_ps(cols->swc2 + c), _mm512_set1_ps(rows->dx[r])));           \
            __m512 e = _mm512_add_ps(t1, t2);                                                          \
            e = _mm512_fmadd_ps(_mm512_load_ps(cols->l2 + c), _mm512_set1_ps(rows->c[r]), e);          \
            e = _mm512_fmadd_ps(_mm512_abs_ps(fv), _mm512_set1_ps(0x1p-14f), e); /* fp32 roundings */ \
            const __m512 hi = _mm512_add_ps(fv, e), lo = _mm512_sub_ps(fv, e);                         \
            lo_max = _mm512_mask_max_ps(lo_max, valid, lo_max, lo);                                    \
            const __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, hi, _mm512_set1_ps(tau), _CMP_GE_OQ); \
            if (keep) {                                                                                \
                const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int32_t)c),                    \
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));          \
                _mm512_mask_compressstoreu_epi32(ls->idx + ls->n, keep, idx);                          \
                _mm512_mask_compressstoreu_ps(ls->hi + ls->n, keep, hi);                               \
                ls->n += __builtin_popcount((unsigned)keep);                                           \
            }                                                                                          \
        }                                                                                              \
        const float m = _mm512_reduce_max_ps(lo_max);                                                  \
        if (m > ls->best_lo) ls->best_lo = m;                                                          \
    }                                                                                                  \
}
GH_KERNEL(1) GH_KERNEL(2) GH_KERNEL(3) GH_KERNEL(4) GH_KERNEL(5) GH_KERNEL(6) GH_KERNEL(7) GH_KERNEL(8)

/* out[m] = argmax_n bf16(x[m] . w[n]) over n < N (first maximum), for M rows of x (bf16, row stride xs).
   The screen (greedy_head.py packs it): rest (KR channel indices), S (KS indices, KS even); wq int8
   [P][K4][48][4] over the rest; ws bf16 [P][KS/2][48][2] over S; colp: the gh_cols arrays sw, swb, swc2, dw,
   l2 (P * 48 floats each, zero past N) and csum. wfull: the head packed for gm_tile (gemm.pack).
   Scratch: xq (M * K4 * 4 bytes), xsb (M * KS bf16), row floats (5M), lists (nt * M * N int32 + floats).
   Returns the number of columns computed again in bf16 (a measure of the screen), or -1 if a row was
   not finite (its out is -1). */
static int64_t gh_argmax(const uint16_t* x, int64_t M, int64_t K, int64_t xs, const int32_t* rest, int64_t KR,
                          const int32_t* S, int64_t KS, const int8_t* wq, const uint16_t* ws,
                          const float* const* colp, const int32_t* csum, const uint16_t* wfull, int64_t N,
                          int64_t* out, uint8_t* xq, uint16_t* xsb, float* rowf, int32_t* list_idx,
                          float* list_hi, int nthreads) {
    const int64_t K4 = (KR + 3) / 4, KQ = 4 * K4, S2 = KS / 2, P = (N + GM_NR - 1) / GM_NR;
    const int64_t panel_q = K4 * 4 * GM_NR, panel_s = S2 * 2 * GM_NR, panel_w = ((K + 1) / 2) * 2 * GM_NR;
    const gh_cols cols = {colp[0], colp[1], colp[2], colp[3], colp[4], csum};
    const gh_rows rows = {rowf, rowf + M, rowf + 2 * M, rowf + 3 * M, rowf + 4 * M};
    const float slack = 1.f + 0x1p-8f;
    int nt = nthreads < 1 ? 1 : nthreads;
    int64_t rechecked = 0, bad = 0;
    gh_list* lists = (gh_list*)malloc(sizeof(gh_list) * nt * M);
    if (!lists) return -2;
    _Pragma("omp parallel num_threads(nt) reduction(+:rechecked, bad)")
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        /* 1. Each row quantized over the rest, its S channels copied, its bound terms. */
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m++) {
            const uint16_t* xr = x + m * xs;
            float amax = 0.f, l1 = 0.f, ss = 0.f, rr = 0.f, dd = 0.f;
            int finite = 1; /* on the bits: -ffast-math lets the compiler assume isfinite() */
            for (int64_t k = 0; k < K; k++) {
                const float v = bf2f(xr[k]);
                finite &= (xr[k] & 0x7f80u) != 0x7f80u;
                ss += v * v;
            }
            for (int64_t j = 0; j < KR; j++) {
                const float v = bf2f(xr[rest[j]]), a = fabsf(v);
                l1 += a;
                rr += v * v;
                if (a > amax) amax = a;
            }
            const float sx = amax > 0.f ? amax / 127.f : 1.f;
            uint8_t* q = xq + m * KQ;
            for (int64_t j = 0; j < KR; j++) {
                const float v = bf2f(xr[rest[j]]), qj = nearbyintf(v / sx), d = v - sx * qj;
                q[j] = (uint8_t)((int)qj + 128);
                dd += d * d;
            }
            for (int64_t j = KR; j < KQ; j++) q[j] = 128;
            for (int64_t j = 0; j < KS; j++) xsb[m * KS + j] = xr[S[j]];
            rows.sx[m] = finite ? sx : -1.f; /* -1: not finite (no candidates: every bound is negative) */
            rows.a[m] = l1 * 0.5f * slack;
            rows.x2[m] = sqrtf(rr) * slack;
            /* d's own roundings are ~2^-17 s_x each: an absolute term covers them */
            rows.dx[m] = sqrtf(dd) * slack + (float)KR * 0x1p-16f * sx;
            rows.c[m] = (float)(K + KS + 8) * 0x1p-23f * sqrtf(ss) * slack;
            for (int t = 0; t < nt; t++) {
                gh_list* ls = lists + t * M + m;
                ls->idx = list_idx + (t * M + m) * N;
                ls->hi = list_hi + (t * M + m) * N;
                ls->n = 0;
                ls->best_lo = -FLT_MAX;
            }
        }
        /* 2. This thread's run of panels: int8 tiles, bounds, candidates. */
        int64_t p0 = P * tid / nth, p1 = P * (tid + 1) / nth;
        const int64_t lines = K4 * 3, tiles = (M + GH_MR - 1) / GH_MR; /* a panel step is 3 cache lines */
        for (int64_t p = p0; p < p1; p++) {
            const int8_t* wp = wq + p * panel_q;
            const uint16_t* sp = ws + p * panel_s;
            /* The next panel is pulled into L2 while this one is read, tile t its t-th part (as gm_panel). */
            const int next = p + 1 < p1;
            if (next)
                for (int64_t b = 0; b < panel_s * 2; b += 64)
                    _mm_prefetch((const char*)(sp + panel_s) + b, _MM_HINT_T1);
            for (int64_t m0 = 0, t = 0; m0 < M; m0 += GH_MR, t++) {
                const int64_t l0 = lines * t / tiles, pf_lines = next ? lines * (t + 1) / tiles - l0 : 0;
                const char* pf = (const char*)(wp + panel_q) + 64 * l0;
                const uint8_t* q = xq + m0 * KQ;
                const uint16_t* s = xsb + m0 * KS;
                gh_list* ls = lists + tid * M + m0;
                const gh_rows rw = {rows.sx + m0, rows.a + m0, rows.x2 + m0, rows.dx + m0, rows.c + m0};
                switch (M - m0 < GH_MR ? M - m0 : GH_MR) {
#define GH_CALL(R) gh_tile_##R(q, KQ, s, KS, K4, S2, wp, pf, pf_lines, sp, &cols, &rw, p * GM_NR, N, ls); break;
                    case 1: GH_CALL(1) case 2: GH_CALL(2) case 3: GH_CALL(3) case 4: GH_CALL(4)
                    case 5: GH_CALL(5) case 6: GH_CALL(6) case 7: GH_CALL(7) default: GH_CALL(8)
#undef GH_CALL
                }
            }
        }
        _Pragma("omp barrier")
        /* 3. Per row: the candidates that reach the final threshold, in column order (thread t's panels
           precede thread t + 1's), computed again panel by panel with the head's own tile. */
        const int amx = gm_use_amx(K); /* then the full head runs on AMX tiles: so does the recompute */
#ifdef GM_AMX
        if (amx) gm_amx_config();
#endif
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t m = 0; m < M; m++) {
            if (rows.sx[m] < 0.f) { out[m] = -1; bad++; continue; }
            const uint16_t* xpad = NULL; /* row m padded to a tile (gm_amx_tail), copied on its first panel */
            float L = -FLT_MAX;
            for (int t = 0; t < nth; t++) if (lists[t * M + m].best_lo > L) L = lists[t * M + m].best_lo;
            const float tau = L - ldexpf(fabsf(L), -6) - 0x1p-90f;
            uint16_t logits[GM_NR] __attribute__((aligned(64)));
            (void)amx; (void)xpad;
            int64_t done_panel = -1, best = -1;
            float best_v = -FLT_MAX;
            for (int t = 0; t < nth; t++) {
                const gh_list* ls = lists + t * M + m;
                for (int64_t i = 0; i < ls->n; i++) {
                    if (ls->hi[i] < tau) continue;
                    const int64_t n = ls->idx[i], p = n / GM_NR;
                    if (p != done_panel) {
#ifdef GM_AMX
                        if (amx) {
                            if (!xpad) xpad = gm_amx_tail(x + m * xs, 1, K, xs);
                            gm_panel_amx(x + m * xs, 0, 1, K, xs, xpad, wfull + p * panel_w, NULL, NULL, 0, NULL,
                                         NULL, 0, GM_NR, logits, 0);
                        } else
#endif
                        gm_tile_1(x + m * xs, xs, K, wfull + p * panel_w, NULL, 0, NULL, NULL, 0, logits, 0, 0, GM_NR);
                        done_panel = p;
                        rechecked += GM_NR;
                    }
                    const float v = bf2f(logits[n - p * GM_NR]);
                    if (best < 0 || v > best_v) { best = n; best_v = v; }
                }
            }
            out[m] = best;
        }
    }
    free(lists);
    return bad ? -1 : rechecked;
}

int64_t greedy_head_argmax(const nxd_greedy_head_args* a) {
    return gh_argmax(a->x, a->M, a->K, a->xs, a->rest, a->KR, a->S, a->KS, a->wq, a->ws, a->colp, a->csum, a->wfull,
                     a->N, a->out, a->xq, a->xsb, a->rowf, a->list_idx, a->list_hi, a->nthreads);
}
#else
int greedy_head_available(void) { return 0; }
#endif
