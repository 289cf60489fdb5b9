/* Quantized-weight GEMM on integer dot products (part of kernels.c, after qgemm.c): the contract of qgemm_f32
   (out (M, N) = x (M, K) @ W^T (+ res), fp32 x and out, the same nxd_qgemm_args), but each row of x is first
   rounded to int8 per 32-block, so a block's 32 products are integer multiply-adds and only one fp32 FMA per
   block remains. Opt-in (CpuOptions.quant_int8_activations): the activations' rounding changes the results.

   Activations, per row and 32-block b: d = absmax / 127, q = round-to-nearest-even(x / d) in [-127, 127]
   (an all-zero block has d = 0, q = 0), and ds = d * sum(q) (what q4's offsets multiply: sum(x) as rounded).
   Weights as qgemm.c stores them (formats 0 = q4, 1 = q8; fp8 has no integer form and runs qgemm_f32):
   - q4: out = sum_b scale[b] * d_b * sum(code * q) + offset[b] * ds_b, codes unsigned 0..15;
   - q8: out = sum_b scale[b] * d_b * sum(code * q), codes signed.
   The integer block sums are exact (at most 32 * 128 * 127 in magnitude); the fp32 part is one product and
   FMA per block, so against the same math in float64 only fp32 rounding separates them.

   For a fused forward (one translation unit with kernels.c): quantize each linear input once with
   qi8_quantize_rows (every weight row of that linear, and any other linear reading the same normed rows, reuses
   it), then in the parallel region call qi8_rows(format, w row, its scales, its offsets or NULL, xq, xd, xds, nb,
   mt, dot) per weight row: mt <= QI8_T rows of x against one weight row, dot[m] out with q4's offset term
   included; the residual is the caller's (as qgemm_i8_f32 below does). Scratch per M rows of K: M*K int8 +
   2*M*K/32 floats. */

#define QI8_T 8   /* rows of x per pass over a weight row (register tile) */
#define QI8_B 32  /* elements per block */

/* The scales of a block of absolute maximum amax: d (stored) and 1/d (the quantizer's multiplier). One scalar
   expression for every ISA, so all paths round the same activations to the same codes. */
static inline void qi8_scales(float amax, float* d, float* inv) {
    *d = amax / 127.f;
    *inv = amax > 0.f ? 127.f / amax : 0.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline void qi8_quantize_block(const float* x, int8_t* q, float* d, float* ds) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float inv;
    qi8_scales(_mm_cvtss_f32(h), d, &inv);
    const __m256 mul = _mm256_set1_ps(inv);
    __m256i i[4];  /* cvtps rounds to nearest even (MXCSR's default) */
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], mul));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *ds = *d * (float)_mm_cvtsi128_si32(s4);
    /* the packs interleave 128-bit lanes: 4-byte groups come out as 0,2,4,6,1,3,5,7 of the wanted order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* A q4 block's 32 codes as bytes in element order (low nibbles = elements 0-15, high = 16-31): the 16 bytes
   loaded into both halves, the upper half shifted by a nibble, both masked (no shuffle uop). */
static inline __m256i qi8_q4_codes(const uint8_t* p) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
    return _mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0F));
}

/* Eight int32 partial sums of codes . q: unsigned codes against signed q pairwise into int16 (at most
   2 * 128 * 127, no saturation), then pairs of those into int32. q8's signed codes move their sign onto q.
   Where the build has AVX512-VNNI (the avx512bf16 variant), vpdpbusd does both steps in one instruction; with no
   saturation in the two-step form, the sums are the same integers. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i qi8_dot_u8s8(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#else
static inline __m256i qi8_dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif
static inline __m256i qi8_dot_q4(__m256i w, __m256i q) { return qi8_dot_u8s8(w, q); }
static inline __m256i qi8_dot_q8(__m256i w, __m256i q) {
    return qi8_dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
}
#define QI8_LOAD_Q4(p) qi8_q4_codes(p)
#define QI8_LOAD_Q8(p) _mm256_loadu_si256((const __m256i*)(p))

/* For n blocks of one x row: cs[b] = wscale[b] * xd[b] and, where woff is given, the offset term
   sum_b woff[b] * xds[b], eight blocks a vector (per block in the loop, a scalar product, a broadcast and a
   scalar FMA took ~a fifth of a one-row block's uops). */
static inline float qi8_block_scales(const float* wscale, const float* woff, const float* xd, const float* xds,
                                     int64_t n, float* cs) {
    __m256 ov = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= n; b += 8) {
        _mm256_storeu_ps(cs + b, _mm256_mul_ps(_mm256_loadu_ps(wscale + b), _mm256_loadu_ps(xd + b)));
        if (woff) ov = _mm256_fmadd_ps(_mm256_loadu_ps(woff + b), _mm256_loadu_ps(xds + b), ov);
    }
    float so = q_hsum(ov);
    for (; b < n; b++) {
        cs[b] = wscale[b] * xd[b];
        if (woff) so += woff[b] * xds[b];
    }
    return so;
}

/* dot[m] (m < MT) = sum_b wscale[b] * xd[m][b] * (codes_b . q[m]_b) [+ woff[b] * xds[m][b] where OFF] for one
   weight row; MT and OFF constants after inlining (qi8_rows), so the accumulators stay in registers. x rows at
   xq + m * K, xd + m * nb. The blocks go in chunks of QI8_CHUNK whose per-(row, block) scale products are made
   first, eight at a time (qi8_block_scales); within a chunk blocks go in pairs, and up to 4 rows the odd blocks
   get their own accumulators, so at one row consecutive FMAs do not wait on each other's latency. */
#define QI8_CHUNK 64
#define QI8_BLOCK_AVX2(LOAD, DOT, BYTES, b, ACC)                                                              \
    {                                                                                                           \
        const __m256i w = LOAD(wr + (b) * (BYTES));                                                             \
        for (int m = 0; m < MT; m++) {                                                                          \
            const __m256i q = _mm256_loadu_si256((const __m256i*)(xq + (m * nb + (b)) * QI8_B));                \
            ACC[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(w, q)), _mm256_broadcast_ss(&cs[m][(b) - c0]),     \
                                     ACC[m]);                                                                   \
        }                                                                                                       \
    }
#define DEFINE_QI8_ROW_AVX2(NAME, LOAD, DOT, BYTES, OFF)                                                     \
static inline __attribute__((always_inline)) void NAME(const uint8_t* wr, const float* wscale,                 \
                                                       const float* woff, const int8_t* xq, const float* xd,   \
                                                       const float* xds, int64_t nb, int MT, float* dot) {      \
    __m256 acc[QI8_T], odd[QI8_T];                                                                              \
    float so[QI8_T], cs[QI8_T][QI8_CHUNK];                                                                      \
    for (int m = 0; m < MT; m++) { acc[m] = odd[m] = _mm256_setzero_ps(); so[m] = 0.f; }                         \
    for (int64_t c0 = 0; c0 < nb; c0 += QI8_CHUNK) {                                                            \
        const int64_t cn = nb - c0 < QI8_CHUNK ? nb - c0 : QI8_CHUNK, end = c0 + cn;                            \
        for (int m = 0; m < MT; m++)                                                                            \
            so[m] += qi8_block_scales(wscale + c0, OFF ? woff + c0 : NULL, xd + m * nb + c0, xds + m * nb + c0, \
                                      cn, cs[m]);                                                               \
        int64_t b = c0;                                                                                         \
        for (; b + 1 < end; b += 2) {                                                                           \
            Q_PREFETCH(wr + b * (BYTES));                                                                       \
            QI8_BLOCK_AVX2(LOAD, DOT, BYTES, b, acc)                                                            \
            if (MT <= 4) QI8_BLOCK_AVX2(LOAD, DOT, BYTES, b + 1, odd)                                           \
            else QI8_BLOCK_AVX2(LOAD, DOT, BYTES, b + 1, acc)                                                   \
        }                                                                                                       \
        if (b < end) QI8_BLOCK_AVX2(LOAD, DOT, BYTES, b, acc)                                                   \
    }                                                                                                           \
    for (int m = 0; m < MT; m++) dot[m] = q_hsum(MT <= 4 ? _mm256_add_ps(acc[m], odd[m]) : acc[m]) + so[m];   \
}
DEFINE_QI8_ROW_AVX2(qi8_q4_row, QI8_LOAD_Q4, qi8_dot_q4, 16, 1)
DEFINE_QI8_ROW_AVX2(qi8_q8_row, QI8_LOAD_Q8, qi8_dot_q8, 32, 0)

#if Q_TWO_ROWS
/* Two q4 weight rows against one quantized row of x, each row summed as qi8_q4_row sums it at MT 1, for the reason
   qgemm.c's two-row kernels give: a short row's own costs overlap. Not always the same bits: -ffast-math lets
   the compiler contract the scale products' scalar tail (qi8_block_scales) its own way at each inlined site, and
   about one row in 10^4 of the default model's fused forward came out 1 ulp apart. Measured on a 2-core AMD EPYC
   (AVX2), kernel_ab.py with int8 activations: the fused forward's q4 rows two at a time 0.935-0.949x the step;
   the q8 LM head's rows two at a time 1.04-1.06x (slower), so q8 keeps one row. */
/* QI8_BLOCK_AVX2 itself at MT 1 for each row, with that row's codes and scale products. */
#define QI8_TWO_BLOCK(LOAD, DOT, BYTES, W, CS, B, ACC)                                                        \
    {                                                                                                           \
        const uint8_t* wr = (W);                                                                                \
        float(*cs)[QI8_CHUNK] = (CS);                                                                           \
        QI8_BLOCK_AVX2(LOAD, DOT, BYTES, B, ACC)                                                                \
    }
#define DEFINE_QI8_TWO_ROWS_AVX2(NAME, LOAD, DOT, BYTES, OFF)                                                 \
static inline void NAME(const uint8_t* w0, const uint8_t* w1, const float* s0, const float* s1, const float* f0, \
                        const float* f1, const int8_t* xq, const float* xd, const float* xds, int64_t nb,       \
                        float* out0, float* out1) {                                                             \
    enum { MT = 1 };                                                                                            \
    __m256 e0[1] = {_mm256_setzero_ps()}, o0[1] = {e0[0]}, e1[1] = {e0[0]}, o1[1] = {e0[0]};                   \
    float so0 = 0.f, so1 = 0.f, cs0[1][QI8_CHUNK], cs1[1][QI8_CHUNK];                                           \
    for (int64_t c0 = 0; c0 < nb; c0 += QI8_CHUNK) {                                                            \
        const int64_t cn = nb - c0 < QI8_CHUNK ? nb - c0 : QI8_CHUNK, end = c0 + cn;                            \
        so0 += qi8_block_scales(s0 + c0, OFF ? f0 + c0 : NULL, xd + c0, xds + c0, cn, cs0[0]);                  \
        so1 += qi8_block_scales(s1 + c0, OFF ? f1 + c0 : NULL, xd + c0, xds + c0, cn, cs1[0]);                  \
        int64_t b = c0;                                                                                         \
        for (; b + 1 < end; b += 2) {                                                                           \
            Q_PREFETCH(w0 + b * (BYTES));                                                                       \
            Q_PREFETCH(w1 + b * (BYTES));                                                                       \
            QI8_TWO_BLOCK(LOAD, DOT, BYTES, w0, cs0, b, e0)                                                     \
            QI8_TWO_BLOCK(LOAD, DOT, BYTES, w1, cs1, b, e1)                                                     \
            QI8_TWO_BLOCK(LOAD, DOT, BYTES, w0, cs0, b + 1, o0)                                                 \
            QI8_TWO_BLOCK(LOAD, DOT, BYTES, w1, cs1, b + 1, o1)                                                 \
        }                                                                                                       \
        if (b < end) {                                                                                          \
            QI8_TWO_BLOCK(LOAD, DOT, BYTES, w0, cs0, b, e0)                                                     \
            QI8_TWO_BLOCK(LOAD, DOT, BYTES, w1, cs1, b, e1)                                                     \
        }                                                                                                       \
    }                                                                                                           \
    *out0 = q_hsum(_mm256_add_ps(e0[0], o0[0])) + so0;                                                          \
    *out1 = q_hsum(_mm256_add_ps(e1[0], o1[0])) + so1;                                                          \
}
DEFINE_QI8_TWO_ROWS_AVX2(qi8_q4_two_rows, QI8_LOAD_Q4, qi8_dot_q4, 16, 1)
#endif

#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

static inline void qi8_quantize_block(const float* x, int8_t* q, float* d, float* ds) {
    float32x4_t v[8], m = vdupq_n_f32(0.f);
    for (int j = 0; j < 8; j++) {
        v[j] = vld1q_f32(x + 4 * j);
        m = vmaxq_f32(m, vabsq_f32(v[j]));
    }
    float inv;
    qi8_scales(vmaxvq_f32(m), d, &inv);
    int32x4_t sum = vdupq_n_s32(0);
    for (int j = 0; j < 4; j++) {  /* vcvtnq: round to nearest even, as the other paths */
        const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(v[2 * j], inv));
        const int32x4_t b = vcvtnq_s32_f32(vmulq_n_f32(v[2 * j + 1], inv));
        sum = vaddq_s32(sum, vaddq_s32(a, b));
        vst1_s8(q + 8 * j, vqmovn_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b))));
    }
    *ds = *d * (float)vaddvq_s32(sum);
}

/* int32x4 partial sums of a block's 32 products: the dot-product instruction where the target has it (the
   neon variant, armv8.2-a+dotprod), else widening multiplies (products at most 128 * 127, pairs in int16). */
static inline int32x4_t qi8_dot_block(int8x16_t w0, int8x16_t w1, const int8_t* q) {
    const int8x16_t q0 = vld1q_s8(q), q1 = vld1q_s8(q + 16);
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, q0), w1, q1);
#else
    int16x8_t a = vmull_s8(vget_low_s8(w0), vget_low_s8(q0));
    a = vmlal_s8(a, vget_high_s8(w0), vget_high_s8(q0));
    int16x8_t b = vmull_s8(vget_low_s8(w1), vget_low_s8(q1));
    b = vmlal_s8(b, vget_high_s8(w1), vget_high_s8(q1));
    return vpadalq_s16(vpaddlq_s16(a), b);
#endif
}

static inline void qi8_q4_codes(const uint8_t* p, int8x16_t w[2]) {
    const uint8x16_t bytes = vld1q_u8(p);
    w[0] = vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(0x0F)));
    w[1] = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
}
static inline void qi8_q8_codes(const uint8_t* p, int8x16_t w[2]) {
    w[0] = vld1q_s8((const int8_t*)p);
    w[1] = vld1q_s8((const int8_t*)p + 16);
}

#define DEFINE_QI8_ROW_NEON(NAME, LOAD, BYTES, OFF)                                                          \
static inline __attribute__((always_inline)) void NAME(const uint8_t* wr, const float* wscale,                 \
                                                       const float* woff, const int8_t* xq, const float* xd,   \
                                                       const float* xds, int64_t nb, int MT, float* dot) {      \
    float32x4_t acc[QI8_T];                                                                                     \
    float so[QI8_T];                                                                                            \
    for (int m = 0; m < MT; m++) { acc[m] = vdupq_n_f32(0.f); so[m] = 0.f; }                                    \
    for (int64_t b = 0; b < nb; b++) {                                                                          \
        int8x16_t w[2];                                                                                         \
        LOAD(wr + b * (BYTES), w);                                                                              \
        for (int m = 0; m < MT; m++) {                                                                          \
            const int32x4_t s = qi8_dot_block(w[0], w[1], xq + (m * nb + b) * QI8_B);                           \
            acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(s), wscale[b] * xd[m * nb + b]);                         \
            if (OFF) so[m] += woff[b] * xds[m * nb + b];                                                        \
        }                                                                                                       \
    }                                                                                                           \
    for (int m = 0; m < MT; m++) dot[m] = vaddvq_f32(acc[m]) + so[m];                                           \
}
DEFINE_QI8_ROW_NEON(qi8_q4_row, qi8_q4_codes, 16, 1)
DEFINE_QI8_ROW_NEON(qi8_q8_row, qi8_q8_codes, 32, 0)

#else /* portable C: integer loops GCC vectorises where the target allows */

static inline void qi8_quantize_block(const float* x, int8_t* q, float* d, float* ds) {
    float amax = 0.f, inv;
    for (int i = 0; i < QI8_B; i++) amax = fmaxf(amax, fabsf(x[i]));
    qi8_scales(amax, d, &inv);
    int32_t sum = 0;
    for (int i = 0; i < QI8_B; i++) {
        const int32_t v = (int32_t)lrintf(x[i] * inv);  /* the current rounding mode: nearest even */
        q[i] = (int8_t)v;
        sum += v;
    }
    *ds = *d * (float)sum;
}

/* Products as int16 x int16 summed into int32: the pattern compilers turn into pmaddwd-like instructions (SSE2
   has no byte multiply-add; int32 multiplies are emulated there, 2-3x slower than the fp32 kernel). */
static inline int32_t qi8_dot_i16(const int16_t* w, const int8_t* q) {
    int32_t s = 0;
    for (int i = 0; i < QI8_B; i++) s += (int32_t)w[i] * (int16_t)q[i];
    return s;
}
static inline void qi8_q4_widen(const uint8_t* p, int16_t w[QI8_B]) {
    for (int i = 0; i < 16; i++) { w[i] = (int16_t)(p[i] & 0x0F); w[i + 16] = (int16_t)(p[i] >> 4); }
}
static inline void qi8_q8_widen(const uint8_t* p, int16_t w[QI8_B]) {
    for (int i = 0; i < QI8_B; i++) w[i] = (int16_t)(int8_t)p[i];
}

#define DEFINE_QI8_ROW_C(NAME, WIDEN, BYTES, OFF)                                                            \
static inline __attribute__((always_inline)) void NAME(const uint8_t* wr, const float* wscale,                 \
                                                       const float* woff, const int8_t* xq, const float* xd,   \
                                                       const float* xds, int64_t nb, int MT, float* dot) {      \
    float acc[QI8_T] = {0.f};                                                                                   \
    for (int64_t b = 0; b < nb; b++) {                                                                          \
        int16_t w[QI8_B];                                                                                       \
        WIDEN(wr + b * (BYTES), w);                                                                             \
        for (int m = 0; m < MT; m++) {                                                                          \
            acc[m] += (wscale[b] * xd[m * nb + b]) * (float)qi8_dot_i16(w, xq + (m * nb + b) * QI8_B);          \
            if (OFF) acc[m] += woff[b] * xds[m * nb + b];                                                       \
        }                                                                                                       \
    }                                                                                                           \
    for (int m = 0; m < MT; m++) dot[m] = acc[m];                                                               \
}
DEFINE_QI8_ROW_C(qi8_q4_row, qi8_q4_widen, 16, 1)
DEFINE_QI8_ROW_C(qi8_q8_row, qi8_q8_widen, 32, 0)
#endif

/* M rows of x (row m at x + m * xs, K a multiple of 32) into xq (M, K), xd and ds (M, K / 32), contiguous. */
static inline void qi8_quantize_rows(const float* x, int64_t M, int64_t xs, int64_t K, int8_t* xq, float* xd,
                                     float* ds) {
    const int64_t nb = K / QI8_B;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++)
            qi8_quantize_block(x + m * xs + b * QI8_B, xq + m * K + b * QI8_B, xd + m * nb + b, ds + m * nb + b);
}

/* One weight row (wr, its scales ws and, for q4, offsets wo) against mt (1..QI8_T) quantized rows of x (xq, xd,
   xds as qi8_quantize_rows wrote them, from the tile's first row): dot[m], q4's offset term included, no
   residual. A switch to a constant tile so each size gets its own unrolled body. */
#define QI8_DISPATCH(ROW, mt, ...)                                                                            \
    switch (mt) {                                                                                              \
        case 1: ROW(__VA_ARGS__, 1, dot); break;                                                               \
        case 2: ROW(__VA_ARGS__, 2, dot); break;                                                               \
        case 3: ROW(__VA_ARGS__, 3, dot); break;                                                               \
        case 4: ROW(__VA_ARGS__, 4, dot); break;                                                               \
        case 5: ROW(__VA_ARGS__, 5, dot); break;                                                               \
        case 6: ROW(__VA_ARGS__, 6, dot); break;                                                               \
        case 7: ROW(__VA_ARGS__, 7, dot); break;                                                               \
        default: ROW(__VA_ARGS__, 8, dot); break;                                                              \
    }
static inline void qi8_rows(int fmt, const uint8_t* wr, const float* ws, const float* wo, const int8_t* xq,
                            const float* xd, const float* xds, int64_t nb, int mt, float* dot) {
    if (fmt == 0) {
        QI8_DISPATCH(qi8_q4_row, mt, wr, ws, wo, xq, xd, xds, nb);
    } else {
        QI8_DISPATCH(qi8_q8_row, mt, wr, ws, wo, xq, xd, xds, nb);
    }
}

/* Whether qi8_two_rows takes q4 rows two at a time for this call. */
static inline int qi8_two_rows_serve(int fmt, int64_t M) { return Q_TWO_ROWS && M == 1 && fmt == 0; }

/* q4 weight rows n0 and n1 against one quantized row of x (qi8_two_rows_serve): out0, out1 as qi8_rows gives. */
static inline void qi8_two_rows(const uint8_t* w, int64_t row_bytes, const float* scale, const float* offset,
                                int64_t n0, int64_t n1, const int8_t* xq, const float* xd, const float* xds,
                                int64_t nb, float* out0, float* out1) {
    const uint8_t *w0 = w + n0 * row_bytes, *w1 = w + n1 * row_bytes;
    const float *s0 = scale + n0 * nb, *s1 = scale + n1 * nb, *f0 = offset + n0 * nb, *f1 = offset + n1 * nb;
#if Q_TWO_ROWS
    qi8_q4_two_rows(w0, w1, s0, s1, f0, f1, xq, xd, xds, nb, out0, out1);
#else
    qi8_rows(0, w0, s0, f0, xq, xd, xds, nb, 1, out0);
    qi8_rows(0, w1, s1, f1, xq, xd, xds, nb, 1, out1);
#endif
}

/* Calls of this many rows of x or more take the fp32 kernels instead: in the AVX2 build, from where its paired
   rows start (Q_PAIR_MIN), which hold their loads in registers. The default model's decode step with int8
   activations (kernel_ab.py, this limit against none) took 0.985 / 0.90 / 0.98 / 0.90-0.93 / 0.89 / 0.90-0.91x
   the time at 9 / 12 / 14 / 16 / 32 / 48 rows (perf_notes.md, "int8 activations give way to the paired rows").
   0: no limit. The AVX512 build measured the other way on a Zen 5 EPYC: the same limit there took 1.04 / 1.27 /
   1.28x the time at 9 / 16 / 32 rows (perf_notes.md, session 24), so it has none; NEON and generic: unmeasured. */
#ifndef QI8_MAX_ROWS
#if Q_PAIRS && defined(__AVX2__) && !defined(__AVX512F__)
#define QI8_MAX_ROWS Q_PAIR_MIN
#else
#define QI8_MAX_ROWS 0
#endif
#endif
int qgemm_i8_max_rows(void) { return QI8_MAX_ROWS; }

/* Whether a call of M rows against codes of format fmt runs on int8 activations (fp8 codes have no integer form). */
static inline int qi8_serves(int fmt, int64_t M) {
    return (fmt == 0 || fmt == 1) && (QI8_MAX_ROWS == 0 || M < QI8_MAX_ROWS);
}

void qgemm_i8_f32(const nxd_qgemm_args* a) {
    if (!qi8_serves(a->format, a->M)) {
        qgemm_f32(a);
        return;
    }
    const int64_t M = a->M, K = a->K, N = a->N, nb = a->K / QI8_B;
    const int fmt = a->format;
    const int64_t row_bytes = fmt == 0 ? K / 2 : K;
    const size_t cells = (size_t)(M * K > 0 ? M * K : 1), blocks = (size_t)(M * nb > 0 ? M * nb : 1);
    int8_t* xq = (int8_t*)malloc(cells);
    float* xd = (float*)malloc(sizeof(float) * 2 * blocks);
    if (!xq || !xd) abort();
    float* ds = xd + blocks;
    qi8_quantize_rows(a->x, M, a->xs, K, xq, xd, ds);
    int nt = a->nthreads < 1 ? 1 : a->nthreads;
    if (N * K * (M < 4 ? M : 4) < (1 << 16)) nt = 1; /* as qgemm_f32: too small to wake the other threads */
    int64_t bound[Q_MAX_CHUNKS + 1];
    const int chunks = q_chunks(N, nt, 16, bound);
    q_best* best = q_best_new(a);
    _Pragma("omp parallel num_threads(nt)")
    {
        q_best* mine = q_best_new(a);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int c = 0; c < chunks; c++)
        for (int64_t n = bound[c]; n < bound[c + 1]; n++) {
            if (qi8_two_rows_serve(fmt, M) && n + 1 < bound[c + 1]) {
                float two[2];
                qi8_two_rows(a->w, row_bytes, a->scale, a->offset, n, n + 1, xq, xd, ds, nb, two, two + 1);
                for (int r = 0; r < 2; r++) {
                    float v = two[r];
                    if (a->res) v += a->res[n + r];
                    a->out[n + r] = v;
                    q_best_note(a, mine, 0, n + r, v);
                }
                n++;
                continue;
            }
            const uint8_t* wr = a->w + n * row_bytes;
            const float* ws = a->scale + n * nb;
            for (int64_t m0 = 0; m0 < M; m0 += QI8_T) {
                const int mt = (int)(M - m0 < QI8_T ? M - m0 : QI8_T);
                float dot[QI8_T];
                qi8_rows(fmt, wr, ws, fmt == 0 ? a->offset + n * nb : NULL, xq + m0 * K, xd + m0 * nb,
                         ds + m0 * nb, nb, mt, dot);
                for (int m = 0; m < mt; m++) {
                    float v = dot[m];
                    if (a->res) v += a->res[(m0 + m) * a->rs + n];
                    a->out[(m0 + m) * a->os + n] = v;
                    q_best_note(a, mine, m0 + m, n, v);
                }
            }
        }
        q_best_fold(a, best, mine);
    }
    q_best_out(a, best);
    free(xq);
    free(xd);
}
