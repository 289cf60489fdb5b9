/* The quantizers' scale searches at load (part of kernels.c): quant.py's _int4_search and quantize_fp8's search,
   the same candidates and the same choice per group, one group at a time in cache instead of torch's passes
   over the whole weight per candidate (~20x the time there).

   w (N, K) fp32, K a multiple of group (the caller pads with zeros, as torch's version does); outputs per group
   of each row, (N, K / group):
   - kind 0 (int4): scale and offset (w ~ q * scale + offset, q in 0..15) with the least squared error among the
     RTN step on min/max and, per candidate c = 15 + d (cand[i]), codes round((w - lo) * c / span) refitted by
     least squares, re-rounded and refitted once.
   - kind 1 (fp8 e4m3): scale among base * cand[i] (base = absmax / 448) whose e4m3 codes have the least squared
     error; offset NULL.
   int4 with importance (imatrix.py): each element's squared error weighted by its column's importance.
   Each group is computed whole by one thread (the results do not depend on the split). The loops are plain C
   that GCC vectorises (AVX2 in the avx2 build); rintf is round-half-even, torch.round's rule. fp8 picks torch's
   scales; int4's sums run in another order than torch's, so a near tie may pick the other candidate: tests bound
   the difference in error. Also here: GPTQ's column loop (gptq_int4_f32, at the end). */

#include <float.h>

#define QS_FP8_MAX 448.f
/* Divisions stay divisions, as torch's (a scalar divided by a tensor is torch's reciprocal times the scalar,
   written so below): under -ffast-math GCC would multiply by reciprocals, moving values by an ulp and so, at
   rounding ties, a code. */
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math")

#define QS_INT4_MAX_GROUP 128 /* int4 groups up to this (quant.INT4_GROUPS); fp8 blocks any size */

/* round(v) clamped to 0..15, as torch.round(...).clamp_(0, 15). */
static inline float qs_code4(float v) {
    float q = rintf(v);
    return q < 0.f ? 0.f : (q > 15.f ? 15.f : q);
}

/* Least squares of g ~ q * s + m over n values given the codes q; returns the squared error (with_err, else 0). A
   group whose codes are all equal keeps the RTN step (rtn_s). */
static inline __attribute__((always_inline)) float qs_fit(const float* g, const float* q, int64_t n, float sum_x,
                                                          float rtn_s, int with_err, float* s_out, float* m_out) {
    float sum_q = 0.f, sum_qq = 0.f, sum_qx = 0.f;
    for (int64_t i = 0; i < n; i++) { sum_q += q[i]; sum_qq += q[i] * q[i]; sum_qx += q[i] * g[i]; }
    const float fn = (float)n;
    const float det = fn * sum_qq - sum_q * sum_q;
    const float s = det > 0.f ? (fn * sum_qx - sum_q * sum_x) / (det > 1e-30f ? det : 1e-30f) : rtn_s;
    const float m = (sum_x - s * sum_q) / fn;
    float err = 0.f;
    if (with_err)
        for (int64_t i = 0; i < n; i++) { const float e = q[i] * s + m - g[i]; err += e * e; }
    *s_out = s;
    *m_out = m;
    return err;
}

static inline __attribute__((always_inline)) void qs_int4_group(const float* g, int64_t n, const float* cand,
                                                                int64_t ncand, float* q, float* scale, float* offset) {
    float lo = g[0], hi = g[0], sum_x = 0.f;
    for (int64_t i = 0; i < n; i++) { lo = g[i] < lo ? g[i] : lo; hi = g[i] > hi ? g[i] : hi; sum_x += g[i]; }
    float span = hi - lo;
    span = span > 1e-12f ? span : 1e-12f;
    const float rtn_s = span / 15.f;
    float best_s = rtn_s, best_m = lo, best_err = 0.f;
    for (int64_t i = 0; i < n; i++) {
        const float e = qs_code4((g[i] - lo) / rtn_s) * rtn_s + lo - g[i];
        best_err += e * e;
    }
    const float inv_span = 1.f / span;
    for (int64_t c = 0; c < ncand; c++) {
        const float step = inv_span * cand[c];
        for (int64_t i = 0; i < n; i++) q[i] = qs_code4((g[i] - lo) * step);
        float s, m;
        qs_fit(g, q, n, sum_x, rtn_s, 0, &s, &m);
        s = s > 0.f ? s : rtn_s;
        for (int64_t i = 0; i < n; i++) q[i] = qs_code4((g[i] - m) / s);
        const float err = qs_fit(g, q, n, sum_x, rtn_s, 1, &s, &m);
        if (err < best_err && s > 0.f) { best_err = err; best_s = s; best_m = m; }
    }
    *scale = best_s;
    *offset = best_m;
}

/* qs_int4_group with each element's squared error weighted by its input's importance a[i] > 0 (the calibration
   inputs' mean square, as llama.cpp's imatrix weights its search): the weighted least-squares fit. */
__attribute__((noinline)) static void qs_int4_weighted(const float* g, const float* a, int64_t n, const float* cand,
                                                       int64_t ncand, float* q, float* scale, float* offset) {
    float lo = g[0], hi = g[0], sum_a = 0.f, sum_ax = 0.f;
    for (int64_t i = 0; i < n; i++) {
        lo = g[i] < lo ? g[i] : lo;
        hi = g[i] > hi ? g[i] : hi;
        sum_a += a[i];
        sum_ax += a[i] * g[i];
    }
    float span = hi - lo;
    span = span > 1e-12f ? span : 1e-12f;
    const float rtn_s = span / 15.f;
    float best_s = rtn_s, best_m = lo, best_err = 0.f;
    for (int64_t i = 0; i < n; i++) {
        const float e = qs_code4((g[i] - lo) / rtn_s) * rtn_s + lo - g[i];
        best_err += a[i] * e * e;
    }
    const float inv_span = 1.f / span;
    for (int64_t c = 0; c < ncand; c++) {
        const float step = inv_span * cand[c];
        float s = rtn_s, m = lo;
        for (int pass = 0; pass < 2; pass++) {
            for (int64_t i = 0; i < n; i++) q[i] = pass ? qs_code4((g[i] - m) / s) : qs_code4((g[i] - lo) * step);
            float sum_aq = 0.f, sum_aqq = 0.f, sum_aqx = 0.f;
            for (int64_t i = 0; i < n; i++) {
                sum_aq += a[i] * q[i];
                sum_aqq += a[i] * q[i] * q[i];
                sum_aqx += a[i] * q[i] * g[i];
            }
            const float det = sum_a * sum_aqq - sum_aq * sum_aq;
            s = det > 0.f ? (sum_a * sum_aqx - sum_aq * sum_ax) / det : rtn_s;
            m = (sum_ax - s * sum_aq) / sum_a;
            if (pass == 0) s = s > 0.f ? s : rtn_s;
        }
        float err = 0.f;
        for (int64_t i = 0; i < n; i++) { const float e = q[i] * s + m - g[i]; err += a[i] * e * e; }
        if (err < best_err && s > 0.f) { best_err = err; best_s = s; best_m = m; }
    }
    *scale = best_s;
    *offset = best_m;
}

/* One function per group size, n a constant in each (unrolled, vectorised whole). noinline: a function keeps the
   pragma's options; inlined into OpenMP's outlined loop body it would lose them. */
#define QS_INT4_SIZED(G)                                                                                           \
    __attribute__((noinline)) static void qs_int4_g##G(const float* g, const float* cand, int64_t ncand, float* q,  \
                                                       float* scale, float* offset) {                              \
        qs_int4_group(g, G, cand, ncand, q, scale, offset);                                                        \
    }
QS_INT4_SIZED(32)
QS_INT4_SIZED(64)
QS_INT4_SIZED(128)
__attribute__((noinline)) static void qs_int4_generic(const float* g, int64_t n, const float* cand, int64_t ncand,
                                                      float* q, float* scale, float* offset) {
    qs_int4_group(g, n, cand, ncand, q, scale, offset);
}

/* v rounded to e4m3's grid (half to even; 3 mantissa bits, normals from 2^-6, subnormal step 2^-9), as the value
   torch's cast to float8_e4m3fn and back gives for |v| <= 448. */
static inline float qs_e4m3(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    int32_t e = (int32_t)((bits >> 23) & 0xFF) - 127;
    e = e < -6 ? -6 : e;
    const uint32_t up_bits = (uint32_t)(127 - (e - 3)) << 23, down_bits = (uint32_t)(127 + (e - 3)) << 23;
    float up, down;
    memcpy(&up, &up_bits, 4);
    memcpy(&down, &down_bits, 4);
    return rintf(v * up) * down;  /* powers of two: exact scalings */
}

__attribute__((noinline)) static void qs_fp8_group(const float* g, int64_t n, const float* cand, int64_t ncand,
                                                   float* scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) { const float a = fabsf(g[i]); amax = a > amax ? a : amax; }
    float base = amax / QS_FP8_MAX;
    base = base > 1e-12f ? base : 1e-12f;
    float best_s = base, best_err = FLT_MAX;  /* (no INFINITY: -ffast-math assumes finite values) */
    for (int64_t c = 0; c < ncand; c++) {
        const float s = base * cand[c];
        float err = 0.f;
        for (int64_t i = 0; i < n; i++) { const float e = qs_e4m3(g[i] / s) * s - g[i]; err += e * e; }
        if (err < best_err) { best_err = err; best_s = s; }
    }
    *scale = best_s;
}

void quant_search_f32(const nxd_qsearch_args* a) {
    const int64_t N = a->N, K = a->K, G = a->group, ng = a->K / a->group;
    int nt = a->nthreads < 1 ? 1 : a->nthreads;
    if (N * K < (1 << 14)) nt = 1;
    _Pragma("omp parallel for num_threads(nt) schedule(dynamic, 8)")
    for (int64_t n = 0; n < N; n++) {
        float q[QS_INT4_MAX_GROUP];
        for (int64_t b = 0; b < ng; b++) {
            const float* g = a->w + n * K + b * G;
            float *scale = a->scale + n * ng + b, *offset = a->kind == 0 ? a->offset + n * ng + b : NULL;
            if (a->kind == 0 && a->importance)
                qs_int4_weighted(g, a->importance + b * G, G, a->cand, a->ncand, q, scale, offset);
            else if (a->kind == 0 && G == 32)
                qs_int4_g32(g, a->cand, a->ncand, q, scale, offset);
            else if (a->kind == 0 && G == 64)
                qs_int4_g64(g, a->cand, a->ncand, q, scale, offset);
            else if (a->kind == 0 && G == 128)
                qs_int4_g128(g, a->cand, a->ncand, q, scale, offset);
            else if (a->kind == 0)
                qs_int4_generic(g, G, a->cand, a->ncand, q, scale, offset);
            else
                qs_fp8_group(g, G, a->cand, a->ncand, scale);
        }
    }
}

/* GPTQ's column loop (gptq.py, which says the method) for one tile of rows: w (rows, K) updated in place as the
   columns are quantized in order; u the upper Cholesky factor of H^-1 (K, K); per group the grid searched on the
   row's updated values when its first column comes up. Each row is independent given u, so rows are split over
   threads and, within a thread, taken QS_GPTQ_TILE at a time so each row of u is read once per tile. */
#define QS_GPTQ_TILE 8

static void qs_gptq_tile(float* w, int64_t rows, int64_t K, int64_t G, const float* u, const float* cand,
                         int64_t ncand, uint8_t* codes, float* scale, float* offset) {
    const int64_t ng = K / G;
    float q[QS_INT4_MAX_GROUP], s[QS_GPTQ_TILE], m[QS_GPTQ_TILE], err[QS_GPTQ_TILE];
    for (int64_t i = 0; i < K; i++) {
        const float* ui = u + i * K;
        for (int64_t r = 0; r < rows; r++) {
            float* wr = w + r * K;
            if (i % G == 0) {
                qs_int4_generic(wr + i, G, cand, ncand, q, &s[r], &m[r]);
                scale[r * ng + i / G] = s[r];
                offset[r * ng + i / G] = m[r];
            }
            const float c = qs_code4((wr[i] - m[r]) / s[r]);
            codes[r * K + i] = (uint8_t)c;
            err[r] = (wr[i] - (c * s[r] + m[r])) / ui[i];
        }
        for (int64_t r = 0; r < rows; r++) {
            float* wr = w + r * K;
            const float e = err[r];
            for (int64_t j = i + 1; j < K; j++) wr[j] -= e * ui[j];
        }
    }
}

void gptq_int4_f32(const nxd_gptq_args* a) {
    const int64_t N = a->N, K = a->K, G = a->group, ng = a->K / a->group;
    const int64_t tiles = (N + QS_GPTQ_TILE - 1) / QS_GPTQ_TILE;
    const int nt = a->nthreads < 1 ? 1 : a->nthreads;
    _Pragma("omp parallel for num_threads(nt) schedule(dynamic, 1)")
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t r0 = t * QS_GPTQ_TILE, rows = N - r0 < QS_GPTQ_TILE ? N - r0 : QS_GPTQ_TILE;
        qs_gptq_tile(a->w + r0 * K, rows, K, G, a->u, a->cand, a->ncand, a->codes + r0 * K, a->scale + r0 * ng,
                     a->offset + r0 * ng);
    }
}

#pragma GCC pop_options
