/* Quantized-weight GEMM for a few rows (part of kernels.c): out (M, N) = x (M, K) @ W^T (+ res), fp32 in and out.

   Decode of one sequence reads every weight once a step, so at small M the time is the weight's bytes: a 4-bit
   weight is an eighth of fp32's. The codes are widened to fp32 in registers and multiplied by fp32 activations
   (no activation quantization), so the result is the dense fp32 expansion's to fp32 rounding.

   Formats, all in blocks of 32 along K (K a multiple of 32; the caller pads):
   - q4 (format 0): per row, per block 16 bytes as GGUF lays them (low nibbles = elements 0-15, high = 16-31),
     scale[n, b] and offset[n, b] fp32; w = code * scale + offset. Computed as
     scale * sum(code * x) + offset * sum(x) with the blocks' sums of x taken once per call, so the inner loop is
     unpack, convert, FMA.
   - q8 (format 1): int8 codes (N, K), scale[n, b]; w = code * scale.
   - fp8 (format 2): e4m3fn codes (N, K), scale[n, b] (a row scale is repeated per block); w = code * scale.
   - bf16 (format 3): bf16 weights (N, K), no scale: a bf16 value is the top half of an fp32's bits, so widening
     is a shift. For CPUs without native bf16 arithmetic: half of fp32's bytes read, fp32 products.
   Rows of N are shared out to the threads; each thread streams its rows' codes once for all M rows (in tiles of up
   to QT rows of x, whose accumulators stay in registers). */

#define QT 8 /* rows of x per pass over a weight row: 8 accumulators + 4 widened code vectors fit AVX2's 16 registers */
#define QB 32      /* elements per block */
/* Software prefetch distance in a weight row's codes, in bytes: a thread reads its rows back to back, so this runs
   a few rows ahead. Measured on a 2-core Xeon with AMX, one row of x against 16384 x 2048 codes (cold): 0.75-0.78x
   the time without it at 2048 (2 threads; 0.67-0.73x at 1), 512 and 1024 in between, 4096 no better. The hardware
   prefetcher alone left a thread at 7-8 GB/s of codes, below the one-thread read bandwidth (12 GB/s). */
#ifndef QPF
#define QPF 2048
#endif
#define Q_PREFETCH(p) __builtin_prefetch((const char*)(p) + QPF)

/* How a pass over N weight rows (or row pairs) is cut into chunks that threads take as they free up: each chunk is
   1 / (Q_SHRINK * nt) of the items still left, down to Q_MIN_ITEMS. So the first chunks are long runs of rows (one
   stream of codes a thread) and the last ones short (the threads finish together), and a thread that lost its
   core still leaves the later chunks to the others. Measured on a 2-core AMD EPYC (AVX2), the default model's
   fused forward plus head at one row, medians of interleaved steps (kernel_ab.py), against fixed chunks of about
   a quarter of a thread's share (Q_SHRINK 0, the schedule before): Q_SHRINK 1 0.93-0.98x (most runs 0.945x; int8
   activations 0.92x, 32 rows 0.97-0.98x, a third thread busy 15% of the time 0.95x), 2 0.98-0.99x, 4 1.02x;
   Q_MIN_ITEMS 4-32 the same. More, shorter chunks cost more than the end's imbalance they save: each is a
   claim on a counter shared by the cores and a new stream of codes whose first lines miss. (On a 2-core Xeon,
   fixed chunks of 16 rows had taken 1.24x the time of fixed quarter shares.) */
#ifndef Q_SHRINK
#define Q_SHRINK 1
#endif
#ifndef Q_MIN_ITEMS
#define Q_MIN_ITEMS 8
#endif
#define Q_MAX_CHUNKS 512

/* bound[0..c] of the c chunks (returned) of n items, each a multiple of unit but the last. The smallest chunk is
   also n / (Q_MAX_CHUNKS / 2): then at most Q_MAX_CHUNKS / 2 chunks are of that size, and the shrinking ones before
   them number k ln(Q_MAX_CHUNKS / 2k) for k = Q_SHRINK * nt, at most 95, so the table never fills. */
static inline int q_chunks(int64_t n, int nt, int64_t unit, int64_t* bound) {
    const int64_t share = (int64_t)nt * (Q_SHRINK > 0 ? Q_SHRINK : 4);
    const int64_t fixed = (n + share - 1) / share, spread = (n + Q_MAX_CHUNKS / 2 - 1) / (Q_MAX_CHUNKS / 2);
    const int64_t least = spread > Q_MIN_ITEMS ? spread : Q_MIN_ITEMS;
    int c = 0;
    int64_t at = 0;
    bound[0] = 0;
    while (at < n) {
        int64_t size = Q_SHRINK > 0 ? (n - at + share - 1) / share : fixed;
        if (size < least) size = least;
        size = (size + unit - 1) / unit * unit;
        if (c == Q_MAX_CHUNKS - 1) size = n - at; /* not reached (above); keeps the table's bound regardless */
        at = at + size < n ? at + size : n;
        bound[++c] = at;
    }
    return c;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float q_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 codes of a block as 4 x 8 floats, in element order: each half of the bytes zero-extended straight from
   memory into 32-bit lanes, where the nibbles split with a mask and a shift (two shuffles a block where widening
   the split bytes took six: measured 0.75x the time of a one-row GEMV, the shuffle ports were the bound). */
static inline void q4_widen(const uint8_t* p, __m256 q[4]) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

static inline void q8_widen(const uint8_t* p, __m256 q[4]) {
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * j))));
}

/* e4m3fn bits placed as an fp16's (sign at 15, exponent and mantissa from bit 7) read as value / 256 (see
   attention.c's fp8_row); qgemm_f32 multiplies the 256 back in (FP8_ROW_UNIT). */
static inline void fp8_widen(const uint8_t* p, __m256 q[4]) {
    for (int j = 0; j < 4; j++) {
        __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(p + 8 * j)));
        h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                         _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
        q[j] = _mm256_cvtph_ps(h);
    }
}

/* bf16: each 16-bit value zero-extended into a 32-bit lane and shifted up is the fp32 it stands for. */
static inline __m256 bf16_load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void bf16_widen(const uint8_t* p, __m256 q[4]) {
    for (int j = 0; j < 4; j++) q[j] = bf16_load8((const uint16_t*)p + 8 * j);
}

/* acc[m] (m < MT) = sum over blocks of scale[b] * (codes . x[m]) for one weight row; MT a constant after
   inlining, so the accumulators live in registers. A block's dot is two chains of two (a multiply and an FMA
   each) added, not one chain of four; up to 2 rows of x the odd blocks get their own accumulators. Both so that
   at one row the next block's work does not wait on this one's FMA latency (the one-row GEMV is the decode
   step's whole cost). */
#define ROW_BLOCK_AVX2(WIDEN, BYTES, SCALED, b, ACC)                                                          \
    {                                                                                                          \
        __m256 q[4];                                                                                           \
        WIDEN(wr + (b) * (BYTES), q);                                                                          \
        const float* xb = x + (b) * QB;                                                                        \
        const __m256 s = SCALED ? _mm256_broadcast_ss(block_scale + (b)) : _mm256_set1_ps(1.f);                \
        for (int m = 0; m < MT; m++) {                                                                         \
            const float* xm = xb + m * xs;                                                                     \
            const __m256 lo = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xm + 8),                                   \
                                              _mm256_mul_ps(q[0], _mm256_loadu_ps(xm)));                       \
            const __m256 hi = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24),                                  \
                                              _mm256_mul_ps(q[2], _mm256_loadu_ps(xm + 16)));                  \
            ACC[m] = _mm256_fmadd_ps(_mm256_add_ps(lo, hi), s, ACC[m]);                                        \
        }                                                                                                      \
    }
/* One weight row against MT rows of x, for either vector width (VEC, its block step BLOCK, ZERO, ADD, HSUM). */
#define DEFINE_ROW_X86(NAME, WIDEN, BYTES, SCALED, VEC, BLOCK, ZERO, ADD, HSUM)                                \
static inline __attribute__((always_inline)) void NAME(const uint8_t* wr, const float* block_scale,            \
                                                       const float* x, int64_t xs, int64_t nb, int MT,         \
                                                       float* out) {                                           \
    VEC acc[QT], odd[2];                                                                                       \
    for (int m = 0; m < MT; m++) acc[m] = ZERO();                                                              \
    odd[0] = odd[1] = ZERO();                                                                                  \
    int64_t b = 0;                                                                                             \
    for (; b + 1 < nb; b += 2) {                                                                               \
        Q_PREFETCH(wr + b * (BYTES));                                                                          \
        BLOCK(WIDEN, BYTES, SCALED, b, acc)                                                                    \
        if (MT <= 2) BLOCK(WIDEN, BYTES, SCALED, b + 1, odd)                                                   \
        else BLOCK(WIDEN, BYTES, SCALED, b + 1, acc)                                                           \
    }                                                                                                          \
    if (b < nb) BLOCK(WIDEN, BYTES, SCALED, b, acc)                                                            \
    for (int m = 0; m < MT; m++) out[m] = HSUM(MT <= 2 ? ADD(acc[m], odd[m]) : acc[m]);                        \
}
#define DEFINE_ROW_AVX2(NAME, WIDEN, BYTES, SCALED) \
    DEFINE_ROW_X86(NAME, WIDEN, BYTES, SCALED, __m256, ROW_BLOCK_AVX2, _mm256_setzero_ps, _mm256_add_ps, q_hsum)
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The AVX512 builds (avx512bf16 and its AMX code): a block's 32 codes are two 16-float vectors, so a block is half
   the AVX2 path's instructions (one widening load per 16 codes, one multiply and one FMA per row). The sums are
   ordered differently from the AVX2 build's: the two agree to fp32 rounding, not bit for bit. On a 2-core Xeon
   with AMX, the default model's linears at one row, hot: 0.90x the AVX2 rows' time (head 1.07 vs 1.23 ms). */
static inline void q4_widen16(const uint8_t* p, __m512 q[2]) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
static inline void q8_widen16(const uint8_t* p, __m512 q[2]) {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
}
#define ROW_BLOCK_AVX512(WIDEN, BYTES, SCALED, b, ACC)                                                        \
    {                                                                                                          \
        __m512 q[2];                                                                                           \
        WIDEN(wr + (b) * (BYTES), q);                                                                          \
        const float* xb = x + (b) * QB;                                                                        \
        const __m512 s = _mm512_set1_ps(SCALED ? block_scale[b] : 1.f);                                        \
        for (int m = 0; m < MT; m++) {                                                                         \
            const float* xm = xb + m * xs;                                                                     \
            const __m512 d = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xm + 16),                                   \
                                             _mm512_mul_ps(q[0], _mm512_loadu_ps(xm)));                        \
            ACC[m] = _mm512_fmadd_ps(d, s, ACC[m]);                                                            \
        }                                                                                                      \
    }
static inline __m512 bf16_load16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void bf16_widen16(const uint8_t* p, __m512 q[2]) {
    for (int j = 0; j < 2; j++) q[j] = bf16_load16((const uint16_t*)p + 16 * j);
}
#define DEFINE_ROW_AVX512(NAME, WIDEN, BYTES, SCALED) \
    DEFINE_ROW_X86(NAME, WIDEN, BYTES, SCALED, __m512, ROW_BLOCK_AVX512, _mm512_setzero_ps, _mm512_add_ps,  \
                   _mm512_reduce_add_ps)
DEFINE_ROW_AVX512(q4_row, q4_widen16, 16, 1)
DEFINE_ROW_AVX512(q8_row, q8_widen16, 32, 1)
DEFINE_ROW_AVX512(bf16_row, bf16_widen16, 64, 0)
#else
DEFINE_ROW_AVX2(q4_row, q4_widen, 16, 1)
DEFINE_ROW_AVX2(q8_row, q8_widen, 32, 1)
DEFINE_ROW_AVX2(bf16_row, bf16_widen, 64, 0)

/* Two weight rows against one row of x (a decode step of one sequence). The default model's rows are short (K 576:
   18 blocks), and what each row costs besides its blocks (the call, the tail of its FMA chains, the horizontal
   sum, the q4 offsets' dot) was about a quarter of a one-row GEMV's time on a 2-core AMD EPYC (AVX2): with those
   costs spread over K 16384, a block took 0.72-0.75x the time. Two rows at a time overlap them: the 3072 x 576 q4
   GEMV 0.75-0.86x the time (in cache, one thread), the fused forward plus head at one row 0.913x
   (benchmarks/kernel_ab.py, Q_TWO_ROWS=0 against the default).
   Each row's sums keep the order q4_row / q8_row keep at MT 1, so the results are theirs bit for bit
   (qgemm_check.c checks it). That rests on the compiler treating the offsets' loop alike at each site, as GCC does
   here, since the kernels are built with -ffast-math: the int8-activation rows, whose scalar tails it contracts
   differently from site to site, differ by 1 ulp in about one row in 10^4. */
#ifndef Q_TWO_ROWS
#define Q_TWO_ROWS 1
#endif
/* ROW_BLOCK_AVX2 itself at MT 1 for each row, so the two rows' arithmetic is the one-row kernel's. */
#define TWO_ROWS_BLOCK(WIDEN, BYTES, W, S, B, ACC)                                                              \
    {                                                                                                            \
        const uint8_t* wr = (W);                                                                                 \
        const float* block_scale = (S);                                                                          \
        ROW_BLOCK_AVX2(WIDEN, BYTES, 1, B, ACC)                                                                  \
    }
#define DEFINE_TWO_ROWS_AVX2(NAME, WIDEN, BYTES)                                                                \
static inline void NAME(const uint8_t* w0, const uint8_t* w1, const float* s0, const float* s1, const float* x,   \
                        int64_t nb, float* out0, float* out1) {                                                  \
    enum { MT = 1 };                                                                                             \
    const int64_t xs = 0;                                                                                        \
    (void)xs;                                                                                                    \
    __m256 e0[1] = {_mm256_setzero_ps()}, o0[1] = {e0[0]}, e1[1] = {e0[0]}, o1[1] = {e0[0]};                    \
    int64_t b = 0;                                                                                               \
    for (; b + 1 < nb; b += 2) {                                                                                 \
        Q_PREFETCH(w0 + b * (BYTES));                                                                            \
        Q_PREFETCH(w1 + b * (BYTES));                                                                            \
        TWO_ROWS_BLOCK(WIDEN, BYTES, w0, s0, b, e0)                                                              \
        TWO_ROWS_BLOCK(WIDEN, BYTES, w1, s1, b, e1)                                                              \
        TWO_ROWS_BLOCK(WIDEN, BYTES, w0, s0, b + 1, o0)                                                          \
        TWO_ROWS_BLOCK(WIDEN, BYTES, w1, s1, b + 1, o1)                                                          \
    }                                                                                                            \
    if (b < nb) {                                                                                                \
        TWO_ROWS_BLOCK(WIDEN, BYTES, w0, s0, b, e0)                                                              \
        TWO_ROWS_BLOCK(WIDEN, BYTES, w1, s1, b, e1)                                                              \
    }                                                                                                            \
    *out0 = q_hsum(_mm256_add_ps(e0[0], o0[0]));                                                                 \
    *out1 = q_hsum(_mm256_add_ps(e1[0], o1[0]));                                                                 \
}
DEFINE_TWO_ROWS_AVX2(q4_two_rows, q4_widen, 16)
DEFINE_TWO_ROWS_AVX2(q8_two_rows, q8_widen, 32)
#endif
DEFINE_ROW_AVX2(fp8_block_row, fp8_widen, 32, 1)
#define FP8_ROW_UNIT (256.f) /* fp8_widen's values are value / 256 */

#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

/* ASIMD is part of every armv8-a core, so both aarch64 builds (generic, neon) take this path. A block's 32 codes
   widen into 8 x 4 floats; 8 of them plus up to QT accumulators fit the 32 vector registers. */
static inline void q4_widen(const uint8_t* p, float32x4_t q[8]) {
    const uint8x16_t bytes = vld1q_u8(p);
    const uint8x16_t halves[2] = {vandq_u8(bytes, vdupq_n_u8(0x0F)), vshrq_n_u8(bytes, 4)};
    for (int h = 0; h < 2; h++) {
        const uint16x8_t lo = vmovl_u8(vget_low_u8(halves[h])), hi = vmovl_u8(vget_high_u8(halves[h]));
        q[4 * h + 0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
        q[4 * h + 1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo)));
        q[4 * h + 2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
        q[4 * h + 3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)));
    }
}

static inline void q8_widen(const uint8_t* p, float32x4_t q[8]) {
    for (int h = 0; h < 2; h++) {
        const int8x16_t codes = vld1q_s8((const int8_t*)p + 16 * h);
        const int16x8_t lo = vmovl_s8(vget_low_s8(codes)), hi = vmovl_s8(vget_high_s8(codes));
        q[4 * h + 0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
        q[4 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
        q[4 * h + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
        q[4 * h + 3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
    }
}

/* As the AVX2 path: e4m3fn bits placed as an fp16's read as value / 256 (FP8_ROW_UNIT multiplies it back). */
static inline void fp8_widen(const uint8_t* p, float32x4_t q[8]) {
    for (int h = 0; h < 4; h++) {
        const uint16x8_t b = vmovl_u8(vld1_u8(p + 8 * h));
        const uint16x8_t bits = vorrq_u16(vshlq_n_u16(vandq_u16(b, vdupq_n_u16(0x80)), 8),
                                          vshlq_n_u16(vandq_u16(b, vdupq_n_u16(0x7F)), 7));
        const float16x8_t half = vreinterpretq_f16_u16(bits);
        q[2 * h] = vcvt_f32_f16(vget_low_f16(half));
        q[2 * h + 1] = vcvt_high_f32_f16(half);
    }
}

static inline void bf16_widen(const uint8_t* p, float32x4_t q[8]) {
    for (int j = 0; j < 8; j++) q[j] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t*)p + 4 * j), 16));
}

#define DEFINE_ROW_NEON(NAME, WIDEN, BYTES, SCALED)                                                        \
static inline __attribute__((always_inline)) void NAME(const uint8_t* wr, const float* block_scale,            \
                                                       const float* x, int64_t xs, int64_t nb, int MT,         \
                                                       float* out) {                                           \
    float32x4_t acc[QT];                                                                                       \
    for (int m = 0; m < MT; m++) acc[m] = vdupq_n_f32(0.f);                                                    \
    for (int64_t b = 0; b < nb; b++) {                                                                         \
        float32x4_t q[8];                                                                                      \
        WIDEN(wr + b * (BYTES), q);                                                                            \
        const float* xb = x + b * QB;                                                                          \
        for (int m = 0; m < MT; m++) {                                                                         \
            const float* xm = xb + m * xs;                                                                     \
            float32x4_t dot = vmulq_f32(q[0], vld1q_f32(xm));                                                  \
            for (int j = 1; j < 8; j++) dot = vfmaq_f32(dot, q[j], vld1q_f32(xm + 4 * j));                     \
            acc[m] = SCALED ? vfmaq_n_f32(acc[m], dot, block_scale[b]) : vaddq_f32(acc[m], dot);               \
        }                                                                                                      \
    }                                                                                                          \
    for (int m = 0; m < MT; m++) out[m] = vaddvq_f32(acc[m]);                                                  \
}
DEFINE_ROW_NEON(q4_row, q4_widen, 16, 1)
DEFINE_ROW_NEON(q8_row, q8_widen, 32, 1)
DEFINE_ROW_NEON(fp8_block_row, fp8_widen, 32, 1)
DEFINE_ROW_NEON(bf16_row, bf16_widen, 64, 0)
#define FP8_ROW_UNIT (256.f)

#else /* portable C: a block's codes widened into a float[32], then plain loops GCC vectorises (-ffast-math) */

static inline void q4_widen(const uint8_t* p, float q[QB]) {
    for (int i = 0; i < 16; i++) { q[i] = (float)(p[i] & 0x0F); q[i + 16] = (float)(p[i] >> 4); }
}
static inline void q8_widen(const uint8_t* p, float q[QB]) {
    for (int i = 0; i < QB; i++) q[i] = (float)(int8_t)p[i];
}
static inline void fp8_widen(const uint8_t* p, float q[QB]) {
    for (int i = 0; i < QB; i++) q[i] = E4M3(p[i]);
}
static inline void bf16_widen(const uint8_t* p, float q[QB]) {
    for (int i = 0; i < QB; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        const uint32_t bits = (uint32_t)h << 16;
        memcpy(q + i, &bits, 4);
    }
}

#define DEFINE_ROW_C(NAME, WIDEN, BYTES, SCALED)                                                           \
static inline __attribute__((always_inline)) void NAME(const uint8_t* wr, const float* block_scale,            \
                                                       const float* x, int64_t xs, int64_t nb, int MT,         \
                                                       float* out) {                                           \
    float acc[QT] = {0.f};                                                                                     \
    for (int64_t b = 0; b < nb; b++) {                                                                         \
        float q[QB];                                                                                           \
        WIDEN(wr + b * (BYTES), q);                                                                            \
        for (int m = 0; m < MT; m++) {                                                                         \
            const float* xm = x + m * xs + b * QB;                                                             \
            float dot = 0.f;                                                                                   \
            for (int i = 0; i < QB; i++) dot += q[i] * xm[i];                                                  \
            acc[m] += SCALED ? block_scale[b] * dot : dot;                                                   \
        }                                                                                                      \
    }                                                                                                          \
    for (int m = 0; m < MT; m++) out[m] = acc[m];                                                              \
}
DEFINE_ROW_C(q4_row, q4_widen, 16, 1)
DEFINE_ROW_C(q8_row, q8_widen, 32, 1)
DEFINE_ROW_C(fp8_block_row, fp8_widen, 32, 1)
DEFINE_ROW_C(bf16_row, bf16_widen, 64, 0)
#define FP8_ROW_UNIT (1.f)
#endif

/* One weight row against MT rows of x: dot[m] for m < MT. A switch to constant MT so each tile size gets its own
   unrolled body. */
#define DISPATCH_MT(ROW, wr, bs, x, xs, nb, mt, dot)                                                        \
    switch (mt) {                                                                                            \
        case 1: ROW(wr, bs, x, xs, nb, 1, dot); break;                                                       \
        case 2: ROW(wr, bs, x, xs, nb, 2, dot); break;                                                       \
        case 3: ROW(wr, bs, x, xs, nb, 3, dot); break;                                                       \
        case 4: ROW(wr, bs, x, xs, nb, 4, dot); break;                                                       \
        case 5: ROW(wr, bs, x, xs, nb, 5, dot); break;                                                       \
        case 6: ROW(wr, bs, x, xs, nb, 6, dot); break;                                                       \
        case 7: ROW(wr, bs, x, xs, nb, 7, dot); break;                                                       \
        default: ROW(wr, bs, x, xs, nb, 8, dot); break;                                                      \
    }

/* The blocks' sums of x (M rows, stride xs, nb blocks): q4's offset term is offset[n, :] . xsum[m, :]. */
static inline void q_block_sums(const float* x, int64_t M, int64_t xs, int64_t nb, float* xsum) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float* xb = x + m * xs + b * QB;
            float s = 0.f;
            for (int i = 0; i < QB; i++) s += xb[i];
            xsum[m * nb + b] = s;
        }
}

/* q4's offset term for one weight row (its nb offsets) and one row of x (its blocks' sums). */
static inline float q4_offset_term(const float* off, const float* xsum, int64_t nb) {
    float s = 0.f;
    for (int64_t b = 0; b < nb; b++) s += off[b] * xsum[b];
    return s;
}

/* dot[m] (m < M) = weight row n . x[m] for a quantized weight (format fmt, rows of row_bytes codes, nb blocks of
   scales and q4 offsets); xsum: q_block_sums of x (q4 only). Tiles of QT rows of x per pass over the row. Shared
   by qgemm_f32 and the fused quantized forward (qdecode.c). */
static inline void q_weight_row(int fmt, const uint8_t* w, const float* scale, const float* offset, int64_t row_bytes,
                                int64_t nb, int64_t n, const float* x, int64_t xs, const float* xsum, int64_t M,
                                float* dot) {
    const uint8_t* wr = w + n * row_bytes;
    const float* bs = scale ? scale + n * nb : NULL; /* bf16 has none */
    for (int64_t m0 = 0; m0 < M; m0 += QT) {
        const int mt = (int)(M - m0 < QT ? M - m0 : QT);
        const float* xt = x + m0 * xs;
        float* d = dot + m0;
        if (fmt == 0) {
            DISPATCH_MT(q4_row, wr, bs, xt, xs, nb, mt, d);
            for (int m = 0; m < mt; m++) d[m] += q4_offset_term(offset + n * nb, xsum + (m0 + m) * nb, nb);
        } else if (fmt == 1) {
            DISPATCH_MT(q8_row, wr, bs, xt, xs, nb, mt, d);
        } else if (fmt == 3) {
            DISPATCH_MT(bf16_row, wr, bs, xt, xs, nb, mt, d);
        } else {
            DISPATCH_MT(fp8_block_row, wr, bs, xt, xs, nb, mt, d);
            for (int m = 0; m < mt; m++) d[m] *= FP8_ROW_UNIT;
        }
    }
}

#ifndef Q_TWO_ROWS
#define Q_TWO_ROWS 0
#endif
/* Whether q_weight_rows2 takes rows two at a time for this call (else it takes them one by one). */
static inline int q_two_rows_serve(int fmt, int64_t M) { return Q_TWO_ROWS && M == 1 && (fmt == 0 || fmt == 1); }

/* dot0[0], dot1[0] = weight rows n0 and n1 . x for one row of x (q_two_rows_serve): q_weight_row's results. */
static inline void q_weight_rows2(int fmt, const uint8_t* w, const float* scale, const float* offset,
                                  int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, const float* x,
                                  const float* xsum, float* dot0, float* dot1) {
#if Q_TWO_ROWS
    const uint8_t *w0 = w + n0 * row_bytes, *w1 = w + n1 * row_bytes;
    if (fmt == 0) {
        q4_two_rows(w0, w1, scale + n0 * nb, scale + n1 * nb, x, nb, dot0, dot1);
        *dot0 += q4_offset_term(offset + n0 * nb, xsum, nb);
        *dot1 += q4_offset_term(offset + n1 * nb, xsum, nb);
    } else {
        q8_two_rows(w0, w1, scale + n0 * nb, scale + n1 * nb, x, nb, dot0, dot1);
    }
#else
    q_weight_row(fmt, w, scale, offset, row_bytes, nb, n0, x, 0, xsum, 1, dot0);
    q_weight_row(fmt, w, scale, offset, row_bytes, nb, n1, x, 0, xsum, 1, dot1);
#endif
}

/* Weight row n of format fmt as fp32 (K values into dst): what the row kernels multiply by, w = code * scale +
   offset (one rounding, an FMA). The paired rows below widen each row once per call into a thread's buffer, and
   q_widen_f32 a whole weight for a call of many rows. */
static inline void q_row_to_f32(int fmt, const uint8_t* w, const float* scale, const float* offset,
                                int64_t row_bytes, int64_t nb, int64_t n, float* dst) {
    const uint8_t* wr = w + n * row_bytes;
    const int64_t block_bytes = row_bytes / nb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* p = wr + b * block_bytes;
        float s = fmt == 3 ? 1.f : scale[n * nb + b], o = fmt == 0 ? offset[n * nb + b] : 0.f;
        if (fmt == 2) s *= FP8_ROW_UNIT;
        float* d = dst + b * QB;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 q[4];
#elif defined(__aarch64__) && defined(__ARM_NEON)
        float32x4_t q[8];
#else
        float q[QB];
#endif
        if (fmt == 0) q4_widen(p, q);
        else if (fmt == 1) q8_widen(p, q);
        else if (fmt == 2) fp8_widen(p, q);
        else bf16_widen(p, q);
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(d + 8 * j, _mm256_fmadd_ps(q[j], vs, vo));
#elif defined(__aarch64__) && defined(__ARM_NEON)
        for (int j = 0; j < 8; j++) vst1q_f32(d + 4 * j, vfmaq_n_f32(vdupq_n_f32(o), q[j], s));
#else
        for (int i = 0; i < QB; i++) d[i] = q[i] * s + o;
#endif
    }
}

/* More than a decode step's rows (a batch of sequences, a prefill chunk) are bound by FLOPs, so two weight rows
   share each load of x and each weight vector serves Q_MR rows of x, one FMA per 8 (16) products, 2 x Q_MR
   accumulators in registers. bf16 rows widen in the loop (a shift); the other formats' rows are widened once per
   call into a thread's fp32 buffer (q_row_to_f32, 2K floats: in L1/L2), so the loop reads fp32 and the
   per-block scales cost nothing there. Rows of W are paired (2i, 2i + 1) whatever the thread split, so results
   do not depend on it; a last odd row takes q_weight_row. x86 (AVX2, AVX512) and aarch64 (NEON); the portable C
   build keeps the row kernel. */
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q_MR 12
#define Q_VEC __m512
#define Q_STEP 16
#define Q_ZERO _mm512_setzero_ps
#define Q_FMA _mm512_fmadd_ps
#define Q_LOADX _mm512_loadu_ps
#define Q_HSUM _mm512_reduce_add_ps
#define BF16_LOADW bf16_load16
#else
#define Q_MR 6
#define Q_VEC __m256
#define Q_STEP 8
#define Q_ZERO _mm256_setzero_ps
#define Q_FMA _mm256_fmadd_ps
#define Q_LOADX _mm256_loadu_ps
#define Q_HSUM q_hsum
#define BF16_LOADW bf16_load8
#endif
#define Q_PAIRS 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* The same structure in 4-float vectors: 24 accumulators, two weight vectors and x fit the 32 registers. Its speed
   is unmeasured (no ARM machine here); the x86 measurements chose the structure. */
#define Q_MR 12
#define Q_VEC float32x4_t
#define Q_STEP 4
#define Q_ZERO() vdupq_n_f32(0.f)
#define Q_FMA(a, b, acc) vfmaq_f32(acc, a, b)
#define Q_LOADX vld1q_f32
#define Q_HSUM vaddvq_f32
static inline float32x4_t bf16_load4(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
#define BF16_LOADW bf16_load4
#define Q_PAIRS 1
#else
#define Q_PAIRS 0
#endif
/* v kept in a register from here. Each vector here feeds 2 (x) or MT (w) FMAs, and GCC otherwise folds the load
   into each of them as a memory operand: at 6 rows of x on AVX2, 14 loads a step for 12 FMAs, which bound the
   loop where 8 loads leave it to the FMAs (Q_X_IN_REG=0 builds leave it to the compiler, for A/B runs). */
#ifndef Q_X_IN_REG
#define Q_X_IN_REG 1
#endif
#if Q_X_IN_REG && defined(__AVX2__) && !defined(__AVX512F__)
#define Q_IN_REG(v) __asm__("" : "+v"(v))
#else /* aarch64's FMAs take no memory operands; GCC's AVX512 build (32 registers) already keeps them: in its
         f32_pair_rows 2 of 156 FMAs take a memory operand (objdump, GCC 12, -march=x86-64-v4) */
#define Q_IN_REG(v) (void)0
#endif
#if Q_PAIRS
/* d0[m], d1[m] (m < MT) = weight rows w0, w1 (K values of type WT, loaded as fp32 vectors by LOADW) . x[m]. */
#define DEFINE_PAIR_TILE(NAME, WT, LOADW)                                                                     \
static inline __attribute__((always_inline)) void NAME(const WT* w0, const WT* w1, const float* x, int64_t xs, \
                                                       int64_t K, int MT, float* d0, float* d1) {             \
    Q_VEC a0[Q_MR], a1[Q_MR];                                                                                  \
    for (int m = 0; m < MT; m++) a0[m] = a1[m] = Q_ZERO();                                                     \
    for (int64_t k = 0; k < K; k += Q_STEP) {                                                                  \
        Q_VEC v0 = LOADW(w0 + k), v1 = LOADW(w1 + k);                                                          \
        Q_IN_REG(v0);                                                                                          \
        Q_IN_REG(v1);                                                                                          \
        for (int m = 0; m < MT; m++) {                                                                         \
            Q_VEC xv = Q_LOADX(x + m * xs + k);                                                                \
            Q_IN_REG(xv);                                                                                      \
            a0[m] = Q_FMA(v0, xv, a0[m]);                                                                      \
            a1[m] = Q_FMA(v1, xv, a1[m]);                                                                      \
        }                                                                                                      \
    }                                                                                                          \
    for (int m = 0; m < MT; m++) {                                                                             \
        d0[m] = Q_HSUM(a0[m]);                                                                                 \
        d1[m] = Q_HSUM(a1[m]);                                                                                 \
    }                                                                                                          \
}
/* The pair's dots for all M rows of x, in tiles of Q_MR (each tile size its own unrolled body). */
#define DEFINE_PAIR_ROWS(NAME, TILE, WT)                                                                      \
static void NAME(const WT* w0, const WT* w1, const float* x, int64_t xs, int64_t K, int64_t M, float* d0,     \
                 float* d1) {                                                                                  \
    for (int64_t m0 = 0; m0 < M; m0 += Q_MR) {                                                                 \
        const int mt = (int)(M - m0 < Q_MR ? M - m0 : Q_MR);                                                   \
        const float* xt = x + m0 * xs;                                                                         \
        switch (mt) {                                                                                          \
            case 1: TILE(w0, w1, xt, xs, K, 1, d0 + m0, d1 + m0); break;                                       \
            case 2: TILE(w0, w1, xt, xs, K, 2, d0 + m0, d1 + m0); break;                                       \
            case 3: TILE(w0, w1, xt, xs, K, 3, d0 + m0, d1 + m0); break;                                       \
            case 4: TILE(w0, w1, xt, xs, K, 4, d0 + m0, d1 + m0); break;                                       \
            case 5: TILE(w0, w1, xt, xs, K, 5, d0 + m0, d1 + m0); break;                                       \
            Q_PAIR_WIDE_CASES(TILE)                                                                            \
            default: TILE(w0, w1, xt, xs, K, Q_MR, d0 + m0, d1 + m0); break;                                   \
        }                                                                                                      \
    }                                                                                                          \
}
#if Q_MR > 6
#define Q_PAIR_WIDE_CASES(TILE)                                                                                \
    case 6: TILE(w0, w1, xt, xs, K, 6, d0 + m0, d1 + m0); break;                                               \
    case 7: TILE(w0, w1, xt, xs, K, 7, d0 + m0, d1 + m0); break;                                               \
    case 8: TILE(w0, w1, xt, xs, K, 8, d0 + m0, d1 + m0); break;                                               \
    case 9: TILE(w0, w1, xt, xs, K, 9, d0 + m0, d1 + m0); break;                                               \
    case 10: TILE(w0, w1, xt, xs, K, 10, d0 + m0, d1 + m0); break;                                             \
    case 11: TILE(w0, w1, xt, xs, K, 11, d0 + m0, d1 + m0); break;
#else
#define Q_PAIR_WIDE_CASES(TILE)
#endif
DEFINE_PAIR_TILE(bf16_pair_tile, uint16_t, BF16_LOADW)
DEFINE_PAIR_TILE(f32_pair_tile, float, Q_LOADX)
DEFINE_PAIR_ROWS(bf16_pair_rows, bf16_pair_tile, uint16_t)
DEFINE_PAIR_ROWS(f32_pair_rows, f32_pair_tile, float)
#endif
/* Rows of x from which the paired path serves (below it the row kernel's latency-hiding order wins): bf16 from 3;
   the other formats, whose rows are widened once per call, from Q_PAIR_MIN (measured: perf_notes.md, "paired
   rows"). In the AVX2 build, with its loads held in registers (Q_IN_REG), from the first row count the row kernel
   needs two passes over a weight row for (QT + 1): the default model's fused step at 9-11 rows 0.82-0.84x the row
   kernel's time, at 6 / 7 / 8 rows 0.87x / 1.05x / 0.99x, at 4 / 5 rows 1.03x / 1.0x (a 2-core AMD EPYC). */
#ifndef BF16_PAIR_MIN
#define BF16_PAIR_MIN 3
#endif
#ifndef Q_PAIR_MIN
#if Q_X_IN_REG && defined(__AVX2__) && !defined(__AVX512F__)
#define Q_PAIR_MIN (QT + 1)
#else
#define Q_PAIR_MIN 12
#endif
#endif

#if Q_PAIRS
/* d0, d1 (M each) = weight rows n0 and n1 . x on the paired rows; wide: 2K floats of the thread's scratch (the
   formats widened once per call; bf16 widens in the loop and leaves it unused). Shared by qgemm_f32 and the fused
   quantized forward (qdecode.c). */
static inline void q_pair_dots(int fmt, const uint8_t* w, const float* scale, const float* offset, int64_t row_bytes,
                               int64_t nb, int64_t n0, int64_t n1, const float* x, int64_t xs, int64_t M, float* d0,
                               float* d1, float* wide) {
    const int64_t K = nb * QB;
    if (fmt == 3) {
        bf16_pair_rows((const uint16_t*)(w + n0 * row_bytes), (const uint16_t*)(w + n1 * row_bytes), x, xs, K, M, d0,
                       d1);
    } else {
        q_row_to_f32(fmt, w, scale, offset, row_bytes, nb, n0, wide);
        q_row_to_f32(fmt, w, scale, offset, row_bytes, nb, n1, wide + K);
        f32_pair_rows(wide, wide + K, x, xs, K, M, d0, d1);
    }
}
#endif
static inline int q_pairs_serve(int fmt, int64_t M) { return Q_PAIRS && M >= (fmt == 3 ? BF16_PAIR_MIN : Q_PAIR_MIN); }

/* Whether this build has the paired rows (every build but portable C): without them a call of many rows is faster
   on a widened copy (quant.py asks). */
int qgemm_paired_available(void) { return Q_PAIRS; }

/* The most rows of x a quantized (or bf16-weight) linear's fp32 call takes on the paired rows; above it, a transient
   fp32 copy of the weight and the dense GEMM (quant.py asks). In the AVX2 build, with its loads in registers,
   the default model at 64 rows (one 64-token prompt chunk, layer by layer): 0.81x the widened copy's time at
   position 64, 0.89x at 1900; 48 decode rows 0.84x (a 2-core AMD EPYC). Others keep 32, measured before that. */
#ifndef Q_PAIR_MAX
#if Q_X_IN_REG && defined(__AVX2__) && !defined(__AVX512F__)
#define Q_PAIR_MAX 64
#else
#define Q_PAIR_MAX 32
#endif
#endif
int qgemm_paired_max_rows(void) { return Q_PAIRS ? Q_PAIR_MAX : 0; }

/* Bytes of one weight row of K elements in format fmt. */
static inline int64_t q_row_bytes(int fmt, int64_t K) { return fmt == 0 ? K / 2 : fmt == 3 ? 2 * K : K; }

/* Greedy tokens taken as the outputs are written (a->argmax): for each row m of x, the first column below
   argmax_cols with the largest output in argmax_rows' order (elementwise.c: -0 as +0, every NaN above all), the
   index that argmax over the written logits gives. Each thread keeps its best per row and folds it into the shared
   one at the end: reading the logits back after the call fetched the half the other core wrote, ~0.1 ms of a ~9 ms
   single-stream step (2-core EPYC, measured). */
typedef struct q_best {
    int32_t key;
    int64_t col;
} q_best;

/* The M bests (the shared ones, or a thread's) before any column: below every key, a column past all. */
static inline q_best* q_best_new(const nxd_qgemm_args* a) {
    if (!a->argmax) return NULL;
    q_best* b = (q_best*)malloc(sizeof(q_best) * (size_t)(a->M > 0 ? a->M : 1));
    if (!b) abort();
    for (int64_t m = 0; m < a->M; m++) {
        b[m].key = INT32_MIN;
        b[m].col = INT64_MAX;
    }
    return b;
}

static inline void q_best_keep(q_best* b, int32_t key, int64_t col) {
    if (key > b->key || (key == b->key && col < b->col)) {
        b->key = key;
        b->col = col;
    }
}

/* Row m's output v at column n: kept where it is the best so far (and n is a greedy column). */
static inline void q_best_note(const nxd_qgemm_args* a, q_best* b, int64_t m, int64_t n, float v) {
    if (!b || n >= a->argmax_cols) return;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    q_best_keep(b + m, argmax_key_f32(u), n);
}

/* A thread's bests into the shared ones (then freed); inside the parallel region. */
static inline void q_best_fold(const nxd_qgemm_args* a, q_best* shared, q_best* mine) {
    if (!mine) return;
    _Pragma("omp critical(q_best)")
    for (int64_t m = 0; m < a->M; m++) q_best_keep(shared + m, mine[m].key, mine[m].col);
    free(mine);
}

/* After the parallel region: the shared bests out as indices, and freed. */
static inline void q_best_out(const nxd_qgemm_args* a, q_best* shared) {
    if (!shared) return;
    for (int64_t m = 0; m < a->M; m++) a->argmax[m] = shared[m].col;
    free(shared);
}

void qgemm_f32(const nxd_qgemm_args* a) {
    const int64_t M = a->M, K = a->K, N = a->N, nb = a->K / QB, xs = a->xs;
    const int fmt = a->format;
    const int64_t row_bytes = q_row_bytes(fmt, K);
    float* xsum = NULL;
    if (fmt == 0) {
        xsum = (float*)malloc(sizeof(float) * (size_t)(M * nb > 0 ? M * nb : 1));
        q_block_sums(a->x, M, xs, nb, xsum);
    }
    int nt = a->nthreads < 1 ? 1 : a->nthreads;
    if (N * K * (M < 4 ? M : 4) < (1 << 16)) nt = 1; /* waking the other threads would cost more than it saves */
    /* Chunks of weight rows taken as threads free up: on a shared machine a descheduled sibling no longer holds
       half the rows (each row is computed whole by one thread, so the results do not depend on the split). */
    int64_t bound[Q_MAX_CHUNKS + 1];
#if Q_PAIRS
    if (q_pairs_serve(fmt, M)) {
        const int64_t pairs = (N + 1) / 2;
        const int chunks = q_chunks(pairs, nt, 1, bound);
        q_best* best = q_best_new(a);
        _Pragma("omp parallel num_threads(nt)")
        {
            q_best* mine = q_best_new(a);
            float* dot = (float*)malloc(sizeof(float) * (size_t)(2 * M));
            float* wide = fmt == 3 ? NULL : (float*)malloc(sizeof(float) * (size_t)(2 * K));
            _Pragma("omp for schedule(dynamic, 1)")
            for (int c = 0; c < chunks; c++)
            for (int64_t p = bound[c]; p < bound[c + 1]; p++) {
                const int64_t n = 2 * p, rows = n + 1 < N ? 2 : 1;
                if (rows == 1) q_weight_row(fmt, a->w, a->scale, a->offset, row_bytes, nb, n, a->x, xs, xsum, M, dot);
                else q_pair_dots(fmt, a->w, a->scale, a->offset, row_bytes, nb, n, n + 1, a->x, xs, M, dot, dot + M, wide);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t m = 0; m < M; m++) {
                        float v = dot[r * M + m];
                        if (a->res) v += a->res[m * a->rs + n + r];
                        a->out[m * a->os + n + r] = v;
                        q_best_note(a, mine, m, n + r, v);
                    }
            }
            q_best_fold(a, best, mine);
            free(wide);
            free(dot);
        }
        q_best_out(a, best);
        free(xsum);
        return;
    }
#endif
    const int chunks = q_chunks(N, nt, 16, bound);
    q_best* best = q_best_new(a);
    _Pragma("omp parallel num_threads(nt)")
    {
        q_best* mine = q_best_new(a);
        float on_stack[64];
        float* dot = M <= 64 ? on_stack : (float*)malloc(sizeof(float) * (size_t)M);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int c = 0; c < chunks; c++)
        for (int64_t n = bound[c]; n < bound[c + 1]; n++) {
            if (q_two_rows_serve(fmt, M) && n + 1 < bound[c + 1]) {
                float d1;
                q_weight_rows2(fmt, a->w, a->scale, a->offset, row_bytes, nb, n, n + 1, a->x, xsum, dot, &d1);
                for (int r = 0; r < 2; r++) {
                    float v = r ? d1 : dot[0];
                    if (a->res) v += a->res[n + r];
                    a->out[n + r] = v;
                    q_best_note(a, mine, 0, n + r, v);
                }
                n++;
                continue;
            }
            q_weight_row(fmt, a->w, a->scale, a->offset, row_bytes, nb, n, a->x, xs, xsum, M, dot);
            for (int64_t m = 0; m < M; m++) {
                float v = dot[m];
                if (a->res) v += a->res[m * a->rs + n];
                a->out[m * a->os + n] = v;
                q_best_note(a, mine, m, n, v);
            }
        }
        q_best_fold(a, best, mine);
        if (dot != on_stack) free(dot);
    }
    q_best_out(a, best);
    free(xsum);
}

/* dst (N, K) fp32 = the whole weight of a's format (q_row_to_f32 per row, rows over nthreads): the transient fp32
   copy for a call of many rows (a prefill chunk), where a dense GEMM wins and keeping the copy would cost the
   codes' memory again several times over. (torch's own .float() of a bf16 49152 x 576 head took ~45 ms on one
   thread, this ~5 ms.) */
void q_widen_f32(const nxd_qgemm_args* a, float* dst) {
    const int64_t K = a->K, N = a->N, nb = K / QB, row_bytes = q_row_bytes(a->format, K);
    const int nt = N * K < (1 << 16) ? 1 : (a->nthreads < 1 ? 1 : a->nthreads);
    _Pragma("omp parallel for num_threads(nt) schedule(static)")
    for (int64_t n = 0; n < N; n++) q_row_to_f32(a->format, a->w, a->scale, a->offset, row_bytes, nb, n, dst + n * K);
}
