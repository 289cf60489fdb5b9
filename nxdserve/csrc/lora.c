/* Multi-LoRA shrink + expand of one linear over a mixed batch, in one call (part of kernels.c).

   punica's BGMV idea: each row runs its own adapter's A then B, so a step with K adapters costs each row one
   adapter's flops (the grouped torch GEMMs make every row pay for all K blocks and then mask K-1 away), and the
   linear costs one call instead of two GEMMs (each a torch dispatch and an OpenMP fork/join, 10-30 us at one
   token, where the arithmetic takes a few us). The S packed modules of a fused linear (q/k/v, gate/up) share
   the row's x: their A rows are stacked, so one pass over x shrinks all of them.

   shrink: s[m, p*R + j] = scale[a] * dot(x[m], A[a, p*R + j])   j < r   (a = idx[m], skipped when < 0)
   expand: out[m, n]   += sum_{j<r} s[m, p*R + j] * Bt[a, j, n]          (p: the slice holding column n)

   R = rmax (the buffers' rank), r = ranks[a] (the adapter's own): each row reads only its adapter's rows, so
   the operands are the stack's resident buffers themselves, whatever the mix of ranks (no per-step gather).
   s stays fp32 (bf16 models: x, A, Bt and out are bf16, every product and sum fp32, out rounded once). */

#define LORA_BLOCK 64           /* output columns per expand task: its fp32 accumulators stay in registers/L1 */
#define LORA_PAR_WORK 131072    /* multiply-adds below which one thread does it all (a fork costs more) */
#define LORA_STACK_S 4096       /* floats of s kept on the stack; more (long prefill chunks) are malloc'd */

/* Two helpers per element type, each with an AVX2/FMA body and a portable one (-O3 -ffast-math lets the compiler
   vectorise those at the target's width: NEON, SSE2):
   lora_dot4: four dot products of x with rows w, w + ldw, ... (n = 4 rows; the shrink's inner loop, x read once);
   lora_axpy: acc[0..len) += sum_{j<r} c[j] * b[j*ldb + 0..len) (the expand, acc kept in registers over j). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float lora_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline __m256 lora_load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 lora_load8_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#define DEFINE_LORA_HELPERS(SUF, T, LOAD)                                                               \
static inline void lora_dot4_##SUF(const T* x, const T* w, int64_t ldw, int64_t K, float* dots) {       \
    __m256 acc[4][2];                                                                                   \
    for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                            \
    int64_t k = 0;                                                                                      \
    for (; k + 16 <= K; k += 16) {                                                                      \
        __m256 x0 = lora_load8_##SUF(x + k), x1 = lora_load8_##SUF(x + k + 8);                         \
        for (int i = 0; i < 4; i++) {                                                                   \
            acc[i][0] = _mm256_fmadd_ps(x0, lora_load8_##SUF(w + i * ldw + k), acc[i][0]);              \
            acc[i][1] = _mm256_fmadd_ps(x1, lora_load8_##SUF(w + i * ldw + k + 8), acc[i][1]);          \
        }                                                                                               \
    }                                                                                                   \
    for (; k + 8 <= K; k += 8) {                                                                        \
        __m256 x0 = lora_load8_##SUF(x + k);                                                            \
        for (int i = 0; i < 4; i++)                                                                     \
            acc[i][0] = _mm256_fmadd_ps(x0, lora_load8_##SUF(w + i * ldw + k), acc[i][0]);              \
    }                                                                                                   \
    for (int i = 0; i < 4; i++) {                                                                       \
        float d = lora_hsum(_mm256_add_ps(acc[i][0], acc[i][1]));                                       \
        for (int64_t kk = k; kk < K; kk++) d += LOAD(x[kk]) * LOAD(w[i * ldw + kk]);                   \
        dots[i] = d;                                                                                    \
    }                                                                                                   \
}                                                                                                       \
static inline void lora_axpy_##SUF(float* acc, const T* b, int64_t ldb, const float* c, int64_t r,      \
                                   int64_t len) {                                                       \
    int64_t n = 0;                                                                                      \
    for (; n + 32 <= len; n += 32) {                                                                    \
        __m256 a0 = _mm256_loadu_ps(acc + n), a1 = _mm256_loadu_ps(acc + n + 8),                        \
               a2 = _mm256_loadu_ps(acc + n + 16), a3 = _mm256_loadu_ps(acc + n + 24);                  \
        for (int64_t j = 0; j < r; j++) {                                                               \
            const T* bj = b + j * ldb + n;                                                              \
            __m256 cj = _mm256_set1_ps(c[j]);                                                           \
            a0 = _mm256_fmadd_ps(cj, lora_load8_##SUF(bj), a0);                                         \
            a1 = _mm256_fmadd_ps(cj, lora_load8_##SUF(bj + 8), a1);                                     \
            a2 = _mm256_fmadd_ps(cj, lora_load8_##SUF(bj + 16), a2);                                    \
            a3 = _mm256_fmadd_ps(cj, lora_load8_##SUF(bj + 24), a3);                                    \
        }                                                                                               \
        _mm256_storeu_ps(acc + n, a0); _mm256_storeu_ps(acc + n + 8, a1);                               \
        _mm256_storeu_ps(acc + n + 16, a2); _mm256_storeu_ps(acc + n + 24, a3);                         \
    }                                                                                                   \
    for (; n + 8 <= len; n += 8) {                                                                      \
        __m256 a0 = _mm256_loadu_ps(acc + n);                                                           \
        for (int64_t j = 0; j < r; j++)                                                                 \
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(c[j]), lora_load8_##SUF(b + j * ldb + n), a0);          \
        _mm256_storeu_ps(acc + n, a0);                                                                  \
    }                                                                                                   \
    for (; n < len; n++)                                                                                \
        for (int64_t j = 0; j < r; j++) acc[n] += c[j] * LOAD(b[j * ldb + n]);                          \
}
#else
#define DEFINE_LORA_HELPERS(SUF, T, LOAD)                                                               \
static inline void lora_dot4_##SUF(const T* x, const T* w, int64_t ldw, int64_t K, float* dots) {       \
    for (int i = 0; i < 4; i++) {                                                                       \
        float d = 0.f;                                                                                  \
        for (int64_t k = 0; k < K; k++) d += LOAD(x[k]) * LOAD(w[i * ldw + k]);                        \
        dots[i] = d;                                                                                    \
    }                                                                                                   \
}                                                                                                       \
static inline void lora_axpy_##SUF(float* acc, const T* b, int64_t ldb, const float* c, int64_t r,      \
                                   int64_t len) {                                                       \
    for (int64_t j = 0; j < r; j++)                                                                     \
        for (int64_t n = 0; n < len; n++) acc[n] += c[j] * LOAD(b[j * ldb + n]);                        \
}
#endif
DEFINE_LORA_HELPERS(f32, float, F32)
DEFINE_LORA_HELPERS(bf16, uint16_t, bf2f)

#define DEFINE_LORA(SUF, T, LOAD, STORE)                                                                \
void lora_add_##SUF(const nxd_lora_args* a) {                                                           \
    const int64_t M = a->M, K = a->K, R = a->rmax, S = a->S, N = a->N, W = S * R, G = (R + 3) / 4;      \
    if (M <= 0 || W <= 0 || N <= 0) return;                                                             \
    const T* x = (const T*)a->x;                                                                        \
    const T* A = (const T*)a->a;                                                                        \
    const T* B = (const T*)a->b;                                                                        \
    T* out = (T*)a->out;                                                                                \
    float s_stack[LORA_STACK_S];                                                                        \
    float* s = M * W <= LORA_STACK_S ? s_stack : (float*)malloc((size_t)(M * W) * sizeof(float));       \
    if (!s) return;                                                                                     \
    int64_t par_work = M * (W * K + R * N);                                                             \
    int nt = par_work >= LORA_PAR_WORK ? a->nthreads : 1;                                               \
    int64_t nblocks = (N + LORA_BLOCK - 1) / LORA_BLOCK;                                                \
    _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                                  \
    {                                                                                                   \
        _Pragma("omp for schedule(static)")                                                             \
        for (int64_t t = 0; t < M * S * G; t++) {  /* (row, module, group of 4 rank rows) */           \
            int64_t m = t / (S * G), p = t / G % S, j0 = t % G * 4;                                    \
            int32_t ad = a->idx[m];                                                                     \
            if (ad < 0 || j0 >= a->ranks[ad]) continue;                                                 \
            const int64_t rows = a->ranks[ad] - j0 < 4 ? a->ranks[ad] - j0 : 4;                        \
            float sc = a->scale ? a->scale[ad] : 1.f, dots[8];                                          \
            const T* w = A + ((int64_t)ad * W + p * R + j0) * K;                                        \
            if (rows == 4) lora_dot4_##SUF(x + m * a->xs, w, K, K, dots);                               \
            else  /* a rank that is not a multiple of 4: its last rows one at a time (ldw 0: 4 copies) */ \
                for (int64_t i = 0; i < rows; i++) lora_dot4_##SUF(x + m * a->xs, w + i * K, 0, K, dots + i); \
            for (int64_t i = 0; i < rows; i++) s[m * W + p * R + j0 + i] = sc * dots[i];                \
        }                                                                                               \
        _Pragma("omp for schedule(static)")                                                             \
        for (int64_t blk = 0; blk < nblocks; blk++) {                                                   \
            const int64_t n0 = blk * LORA_BLOCK, n1 = n0 + LORA_BLOCK < N ? n0 + LORA_BLOCK : N;       \
            float acc[LORA_BLOCK];                                                                      \
            for (int64_t m = 0; m < M; m++) {                                                           \
                int32_t ad = a->idx[m];                                                                 \
                if (ad < 0) continue;                                                                   \
                const int64_t r = a->ranks[ad];                                                         \
                T* orow = out + m * a->os;                                                              \
                for (int64_t n = n0; n < n1; n++) acc[n - n0] = LOAD(orow[n]);                         \
                for (int64_t p = 0; p < S; p++) {  /* the slices that overlap [n0, n1) */               \
                    int64_t lo = a->starts[p] > n0 ? a->starts[p] : n0;                                 \
                    int64_t hi = a->starts[p + 1] < n1 ? a->starts[p + 1] : n1;                         \
                    if (lo >= hi) continue;                                                             \
                    lora_axpy_##SUF(acc + (lo - n0), B + (int64_t)ad * R * N + lo, N, s + m * W + p * R, r, \
                                    hi - lo);                                                           \
                }                                                                                       \
                for (int64_t n = n0; n < n1; n++) orow[n] = STORE(acc[n - n0]);                        \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    if (s != s_stack) free(s);                                                                          \
}
DEFINE_LORA(f32, float, F32, F32)
DEFINE_LORA(bf16, uint16_t, bf2f, f2bf)
