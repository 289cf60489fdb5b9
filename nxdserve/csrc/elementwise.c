/* A decoder layer's elementwise ops (add + RMSNorm, RoPE, SiLU * up) and a row argmax (part of kernels.c). */

/* Elementwise layer ops. Each rounds to the model dtype exactly where torch's eager ops do (bf16: every
   op's result), so outputs match the eager modules up to the order of the fp32 sums in RMSNorm. */
#define PAR_ROWS(rows, cols) int64_t par_work = (rows) * (cols); (void)par_work;                        \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(par_work >= 65536)")

#define DEFINE_ELEMENTWISE(SUF, T, LOAD, STORE, R)                                                      \
/* out = w * to_dtype(x * rsqrt(mean(x^2) + eps)); with delta: x = to_dtype(x + delta) first, into sum */ \
void add_rmsnorm_##SUF(const T* x, const T* delta, const T* w, float eps, T* sum, T* out,               \
                       int64_t rows, int64_t cols, int nthreads) {                                      \
    PAR_ROWS(rows, cols)                                                                                \
    for (int64_t r = 0; r < rows; r++) {                                                                \
        const T* xr = x + r * cols;                                                                     \
        T* orow = out + r * cols;                                                                       \
        float ss = 0.f;                                                                                 \
        if (delta) {                                                                                    \
            const T* dr = delta + r * cols;                                                             \
            T* sr = sum + r * cols;                                                                     \
            for (int64_t c = 0; c < cols; c++) {                                                        \
                float h = R(LOAD(xr[c]) + LOAD(dr[c]));                                                 \
                sr[c] = STORE(h);                                                                       \
                ss += h * h;                                                                            \
            }                                                                                           \
            xr = sr;                                                                                    \
        } else {                                                                                        \
            for (int64_t c = 0; c < cols; c++) { float h = LOAD(xr[c]); ss += h * h; }                  \
        }                                                                                               \
        float inv = 1.f / sqrtf(ss / (float)cols + eps);                                                \
        for (int64_t c = 0; c < cols; c++) orow[c] = STORE(LOAD(w[c]) * R(LOAD(xr[c]) * inv));         \
    }                                                                                                   \
}                                                                                                       \
/* In place on heads [0, nheads) of each row (row stride rs): x = x*cos + rotate_half(x)*sin */          \
void rope_##SUF(T* x, int64_t rs, int64_t rows, int64_t nheads, int64_t D, const T* cos, const T* sin,  \
                int nthreads) {                                                                         \
    int64_t half = D / 2;                                                                               \
    PAR_ROWS(rows, nheads * D)                                                                          \
    for (int64_t r = 0; r < rows; r++) {                                                                \
        const T* cr = cos + r * D;                                                                      \
        const T* sr = sin + r * D;                                                                      \
        for (int64_t h = 0; h < nheads; h++) {                                                          \
            T* xh = x + r * rs + h * D;                                                                 \
            float a[512], b[512];                                                                       \
            for (int64_t d = 0; d < half; d++) { a[d] = LOAD(xh[d]); b[d] = LOAD(xh[d + half]); }       \
            for (int64_t d = 0; d < half; d++) {                                                        \
                xh[d] = STORE(R(R(a[d] * LOAD(cr[d])) + R(-b[d] * LOAD(sr[d]))));                       \
                xh[d + half] = STORE(R(R(b[d] * LOAD(cr[d + half])) + R(a[d] * LOAD(sr[d + half]))));   \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
/* gu (rows, 2*cols) = [gate | up] -> out (rows, cols) = to_dtype(silu(gate)) * up */                    \
void silu_mul_##SUF(const T* gu, T* out, int64_t rows, int64_t cols, int nthreads) {                    \
    PAR_ROWS(rows, cols)                                                                                \
    for (int64_t r = 0; r < rows; r++) {                                                                \
        const T* g = gu + r * 2 * cols;                                                                 \
        const T* u = g + cols;                                                                          \
        T* o = out + r * cols;                                                                          \
        for (int64_t c = 0; c < cols; c++) {                                                            \
            float x = LOAD(g[c]);                                                                       \
            o[c] = STORE(R(x / (1.f + expf(-x))) * LOAD(u[c]));                                         \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_ELEMENTWISE(bf16, uint16_t, bf2f, f2bf, R_bf16)
DEFINE_ELEMENTWISE(f32, float, F32, F32, R_f32)

/* torch.argmax over each row, on the bit patterns: keys that order like the values (a negative value's
   magnitude bits flipped), -0 as +0, every NaN above everything; the first index holding the largest key
   wins, as in torch. Integer-only, so -ffast-math cannot change it. Two passes per row: the largest key,
   then the first block of 64 values that holds it (the row is in L1/L2 by then). */
#if defined(__AVX512BW__)
#include <immintrin.h>
#define ARGMAX_VECTOR 1
/* AVX512 keys for 32-bit (EP=epi32, W=16 lanes) and 16-bit (EP=epi16, W=32 lanes) patterns */
#define ARGMAX_VKEY(EP, EPU, BITS, u, absv, infv, maxv, zero)                                           \
    ({ __m512i a_ = _mm512_and_si512(u, absv);                                                          \
       __m512i k_ = _mm512_xor_si512(u, _mm512_and_si512(_mm512_srai_##EP(u, BITS - 1), absv));         \
       k_ = _mm512_mask_mov_##EP(k_, _mm512_cmpeq_##EP##_mask(a_, zero), zero);                         \
       _mm512_mask_mov_##EP(k_, _mm512_cmpgt_##EPU##_mask(a_, infv), maxv); })
#endif

#define DEFINE_ARGMAX(SUF, U, S, ABS, INF, SMAX)                                                        \
static inline S argmax_key_##SUF(U u) {                                                                 \
    U a = u & ABS;                                                                                      \
    U flip = (U)((S)u >> (8 * sizeof(U) - 1)) & ABS;                                                    \
    S k = a == 0 ? 0 : (S)(u ^ flip);                                                                   \
    return a > INF ? SMAX : k;                                                                          \
}                                                                                                       \
static int64_t argmax_row_##SUF(const U* x, int64_t n) {                                                \
    enum { W = 64 / sizeof(U), BITS = 8 * sizeof(U) };                                                  \
    S best = argmax_key_##SUF(x[0]);                                                                    \
    int64_t c = 0;                                                                                      \
    ARGMAX_VMAX_##SUF                                                                                   \
    for (; c < n; c++) { S k = argmax_key_##SUF(x[c]); best = k > best ? k : best; }                    \
    for (int64_t c0 = 0; c0 < n; c0 += 64) {                                                            \
        int64_t end = c0 + 64 < n ? c0 + 64 : n;                                                        \
        ARGMAX_VFIND_##SUF                                                                              \
        for (int64_t i = c0; i < end; i++) if (argmax_key_##SUF(x[i]) == best) return i;               \
    }                                                                                                   \
    return 0;                                                                                           \
}                                                                                                       \
void argmax_rows_##SUF(const U* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out,            \
                       int nthreads) {                                                                  \
    int64_t par_work = rows * cols; (void)par_work;                                                     \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(rows > 1 && par_work >= 65536)") \
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row_##SUF(x + r * stride, cols);                \
}

#ifdef ARGMAX_VECTOR
#define ARGMAX_VMAX(EP, EPU, SET1, S, ABS, INF, SMAX)                                               \
    if (n >= W) {                                                                                       \
        const __m512i absv = SET1((S)ABS), infv = SET1((S)INF), maxv = SET1((S)SMAX);                   \
        const __m512i zero = _mm512_setzero_si512();                                                    \
        __m512i bv = SET1(best);                                                                        \
        for (; c + W <= n; c += W) {                                                                    \
            __m512i u = _mm512_loadu_si512((const void*)(x + c));                                       \
            bv = _mm512_max_##EP(bv, ARGMAX_VKEY(EP, EPU, BITS, u, absv, infv, maxv, zero));            \
        }                                                                                               \
        S lanes[W];                                                                                     \
        _mm512_storeu_si512((void*)lanes, bv);                                                          \
        for (int i = 0; i < W; i++) best = lanes[i] > best ? lanes[i] : best;                           \
    }
#define ARGMAX_VFIND(EP, EPU, SET1, S, ABS, INF, SMAX)                                              \
    if (end - c0 == 64) {                                                                               \
        const __m512i absv = SET1((S)ABS), infv = SET1((S)INF), maxv = SET1((S)SMAX);                   \
        const __m512i zero = _mm512_setzero_si512(), bestv = SET1(best);                                \
        int found = 0;                                                                                  \
        for (int64_t j = c0; j < end; j += W) {                                                         \
            __m512i u = _mm512_loadu_si512((const void*)(x + j));                                       \
            found |= _mm512_cmpeq_##EP##_mask(ARGMAX_VKEY(EP, EPU, BITS, u, absv, infv, maxv, zero), bestv) != 0; \
        }                                                                                               \
        if (!found) continue;                                                                           \
    }
#define ARGMAX_VMAX_bf16 ARGMAX_VMAX(epi16, epu16, _mm512_set1_epi16, int16_t, 0x7fff, 0x7f80, INT16_MAX)
#define ARGMAX_VFIND_bf16 ARGMAX_VFIND(epi16, epu16, _mm512_set1_epi16, int16_t, 0x7fff, 0x7f80, INT16_MAX)
#define ARGMAX_VMAX_f32 ARGMAX_VMAX(epi32, epu32, _mm512_set1_epi32, int32_t, 0x7fffffff, 0x7f800000, INT32_MAX)
#define ARGMAX_VFIND_f32 ARGMAX_VFIND(epi32, epu32, _mm512_set1_epi32, int32_t, 0x7fffffff, 0x7f800000, INT32_MAX)
#elif defined(__AVX2__)
#include <immintrin.h>
/* The same keys on AVX2's 256-bit vectors (V lanes). The magnitude bits are non-negative as signed values, so
   AVX2's signed compares order them; a lane mask from a compare is all ones, so the byte blend selects it whole.
   Measured on one decode row of SmolLM2's logits (49152 fp32, AVX2-only Zen 3): 156 us on the scalar loop,
   46 us here. */
#define ARGMAX_VKEY(EP, BITS, u, absv, infv, maxv, zero)                                                \
    ({ __m256i a_ = _mm256_and_si256(u, absv);                                                          \
       __m256i k_ = _mm256_xor_si256(u, _mm256_and_si256(_mm256_srai_##EP(u, BITS - 1), absv));         \
       k_ = _mm256_andnot_si256(_mm256_cmpeq_##EP(a_, zero), k_);                                       \
       _mm256_blendv_epi8(k_, maxv, _mm256_cmpgt_##EP(a_, infv)); })
#define ARGMAX_VMAX(EP, SET1, S, ABS, INF, SMAX)                                                    \
    {                                                                                                   \
        enum { V = 32 / sizeof(S) };                                                                    \
        if (n >= 2 * V) {                                                                               \
            const __m256i absv = SET1((S)ABS), infv = SET1((S)INF), maxv = SET1((S)SMAX);               \
            const __m256i zero = _mm256_setzero_si256();                                                \
            __m256i b0 = SET1(best), b1 = b0;                                                           \
            for (; c + 2 * V <= n; c += 2 * V) {                                                        \
                __m256i u0 = _mm256_loadu_si256((const __m256i*)(x + c));                               \
                __m256i u1 = _mm256_loadu_si256((const __m256i*)(x + c + V));                           \
                b0 = _mm256_max_##EP(b0, ARGMAX_VKEY(EP, BITS, u0, absv, infv, maxv, zero));           \
                b1 = _mm256_max_##EP(b1, ARGMAX_VKEY(EP, BITS, u1, absv, infv, maxv, zero));           \
            }                                                                                           \
            S lanes[V];                                                                                 \
            _mm256_storeu_si256((__m256i*)lanes, _mm256_max_##EP(b0, b1));                              \
            for (int i = 0; i < V; i++) best = lanes[i] > best ? lanes[i] : best;                       \
        }                                                                                               \
    }
#define ARGMAX_VFIND(EP, SET1, S, ABS, INF, SMAX)                                                   \
    if (end - c0 == 64) {                                                                               \
        enum { V = 32 / sizeof(S) };                                                                    \
        const __m256i absv = SET1((S)ABS), infv = SET1((S)INF), maxv = SET1((S)SMAX);                   \
        const __m256i zero = _mm256_setzero_si256(), bestv = SET1(best);                                \
        int found = 0;                                                                                  \
        for (int64_t j = c0; j < end; j += V) {                                                         \
            __m256i u = _mm256_loadu_si256((const __m256i*)(x + j));                                    \
            found |= _mm256_movemask_epi8(                                                              \
                _mm256_cmpeq_##EP(ARGMAX_VKEY(EP, BITS, u, absv, infv, maxv, zero), bestv)) != 0;       \
        }                                                                                               \
        if (!found) continue;                                                                           \
    }
#define ARGMAX_VMAX_bf16 ARGMAX_VMAX(epi16, _mm256_set1_epi16, int16_t, 0x7fff, 0x7f80, INT16_MAX)
#define ARGMAX_VFIND_bf16 ARGMAX_VFIND(epi16, _mm256_set1_epi16, int16_t, 0x7fff, 0x7f80, INT16_MAX)
#define ARGMAX_VMAX_f32 ARGMAX_VMAX(epi32, _mm256_set1_epi32, int32_t, 0x7fffffff, 0x7f800000, INT32_MAX)
#define ARGMAX_VFIND_f32 ARGMAX_VFIND(epi32, _mm256_set1_epi32, int32_t, 0x7fffffff, 0x7f800000, INT32_MAX)
#else
#define ARGMAX_VMAX_bf16
#define ARGMAX_VFIND_bf16
#define ARGMAX_VMAX_f32
#define ARGMAX_VFIND_f32
#endif

DEFINE_ARGMAX(bf16, uint16_t, int16_t, 0x7fffu, 0x7f80u, INT16_MAX)
DEFINE_ARGMAX(f32, uint32_t, int32_t, 0x7fffffffu, 0x7f800000u, INT32_MAX)
