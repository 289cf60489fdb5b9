"""C source of the fused small-batch decoder forward (compiled with the other kernels in ``cpu_kernels``).

At a few tokens per step a decoder's forward is a stream of matrix-vector products over the weights,
and the time goes to what lies between them: about ten framework calls per layer, each an OpenMP
fork and join, during which no weight bytes move. ``decode_forward_bf16`` runs every layer for a few
tokens (``fused_decode.MAX_TOKENS``) inside ONE parallel region: each thread owns a fixed share of every
weight matrix (whole heads of the q/k/v projection, so RoPE and the K/V cache write need no other thread's
results), threads meet at five barriers per layer, and the matrix-vector products use AVX512-BF16
dot products (``vdpbf16ps``: bf16 pairs multiplied exactly, summed in fp32).

Rounding follows the eager bf16 layer: every projection's output, residual sum, RMSNorm output,
RoPE product and activation is rounded to bf16 where torch rounds it. The fp32 sums inside a
projection run in a different order than oneDNN's, so results agree with the eager path to bf16
rounding, not bit for bit (fp32 models never use this path).

Built only where the compiler targets AVX512-BF16 (``decode_forward_available()`` says so).
"""

SOURCE = r"""
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

int decode_forward_available(void) { return 1; }

/* Inclusive-exclusive share [lo, hi) of n items for thread tid of nt, in multiples of align. */
static inline void df_share(int64_t n, int64_t align, int tid, int nt, int64_t* lo, int64_t* hi) {
    int64_t units = (n + align - 1) / align;
    *lo = (units * tid / nt) * align;
    *hi = (units * (tid + 1) / nt) * align;
    if (*hi > n) *hi = n;
    if (*lo > n) *lo = n;
}


/* Weights in the tiled layout (``fused_decode.tile_weight``): rows in blocks of four, each block stored
   as [K/32 chunks][4 rows][32 values], zero-padded to whole blocks and chunks. A block is then one
   sequential stream: measured 1.5x (2 threads) to 2x (1 thread) the bandwidth of reading four rows of
   the plain row-major layout side by side, which the hardware prefetchers follow badly. */
#define DF_CHUNK(w) ((__m512bh)_mm512_load_si512(w))

/* y[t * ys + r] = sum_k x[t * K + k] * block[r][k] in fp32 for TN tokens (a compile-time count, so the
   TN x 4 accumulators stay in registers) and the nr (<= 4) real rows of one tiled block. */
#define DF_TILE(TN)                                                                                     \
static inline void df_tile_##TN(const uint16_t* x, const uint16_t* blk, int64_t K, int64_t nr,          \
                                float* y, int64_t ys) {                                                 \
    __m512 acc[TN][4];                                                                                  \
    for (int t = 0; t < TN; t++)                                                                        \
        for (int r = 0; r < 4; r++) acc[t][r] = _mm512_setzero_ps();                                    \
    for (int64_t k = 0; k < K; k += 32, blk += 128) {                                                   \
        __m512bh wv0 = DF_CHUNK(blk), wv1 = DF_CHUNK(blk + 32), wv2 = DF_CHUNK(blk + 64);               \
        __m512bh wv3 = DF_CHUNK(blk + 96);                                                              \
        __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);        \
        for (int t = 0; t < TN; t++) {                                                                  \
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * K + k);                         \
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], xv, wv0);                                           \
            acc[t][1] = _mm512_dpbf16_ps(acc[t][1], xv, wv1);                                           \
            acc[t][2] = _mm512_dpbf16_ps(acc[t][2], xv, wv2);                                           \
            acc[t][3] = _mm512_dpbf16_ps(acc[t][3], xv, wv3);                                           \
        }                                                                                               \
    }                                                                                                   \
    for (int t = 0; t < TN; t++) {                                                                      \
        float s[4] = {_mm512_reduce_add_ps(acc[t][0]), _mm512_reduce_add_ps(acc[t][1]),                 \
                      _mm512_reduce_add_ps(acc[t][2]), _mm512_reduce_add_ps(acc[t][3])};                \
        for (int64_t r = 0; r < nr; r++) y[t * ys + r] = s[r];                                          \
    }                                                                                                   \
}
DF_TILE(1)
DF_TILE(2)
DF_TILE(3)
DF_TILE(4)

/* y[t * ys + n] = sum_k x[t * K + k] * w[n, k] in fp32, for rows n in [n0, n1) (n0 a multiple of 4) and
   t < T, w tiled. Each block is read once and reused for every token (from L1 after the first). */
static void df_gemv(const uint16_t* x, int64_t T, const uint16_t* w, int64_t K, int64_t n0, int64_t n1,
                    float* y, int64_t ys) {
    const int64_t block_size = 4 * ((K + 31) / 32) * 32;
    for (int64_t n = n0; n < n1; n += 4) {
        int64_t nr = n1 - n < 4 ? n1 - n : 4;
        const uint16_t* blk = w + (n / 4) * block_size;
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const uint16_t* xt = x + t0 * K;
            float* yt = y + t0 * ys + n;
            switch (T - t0 < 4 ? T - t0 : 4) {
                case 1: df_tile_1(xt, blk, K, nr, yt, ys); break;
                case 2: df_tile_2(xt, blk, K, nr, yt, ys); break;
                case 3: df_tile_3(xt, blk, K, nr, yt, ys); break;
                default: df_tile_4(xt, blk, K, nr, yt, ys); break;
            }
        }
    }
}

/* out (T, N) = bf16(x (T, K) @ w (N, K)^T + b), w tiled, its rows split over the threads: a small-batch
   linear layer (the LM head, a draft head's layers) in one parallel region. */
void linear_small_bf16(const uint16_t* x, int64_t T, const uint16_t* w, const uint16_t* b, int64_t N, int64_t K,
                       uint16_t* out, float* fs, int nthreads) {
    int nt = nthreads < 1 ? 1 : nthreads;
    _Pragma("omp parallel num_threads(nt)")
    {
        int64_t lo, hi;
        df_share(N, 16, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        df_gemv(x, T, w, K, lo, hi, fs, N);
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = lo; n < hi; n++) out[t * N + n] = f2bf(fs[t * N + n] + (b ? bf2f(b[n]) : 0.f));
    }
}

/* out rows = w * bf16(x * rsqrt(mean(x^2) + eps)), as add_rmsnorm_bf16 without the residual. */
static void df_rmsnorm(const uint16_t* x, const uint16_t* w, float eps, uint16_t* out, int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* xr = x + t * H;
        float ss = 0.f;
        for (int64_t c = 0; c < H; c++) { float h = bf2f(xr[c]); ss += h * h; }
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t c = 0; c < H; c++) out[t * H + c] = f2bf(bf2f(w[c]) * R_bf16(bf2f(xr[c]) * inv));
    }
}

/* Per layer, 10 pointers: input norm, qkv weight, qkv bias, o weight, o bias, post norm, gate_up weight,
   gate_up bias, down weight, down bias (weights tiled, biases may be NULL); then the layer's K and V cache bases
   (slots, kv heads, max_len, D) as two more pointers; windows[l] > 0 for a sliding window.
   x (T, H): the embeddings in, the final-norm hidden states out. cos/sin (T, D): the tokens' RoPE rows.
   Token t writes its K/V at (slots[t], pos[t]) and attends to keys lo..pos[t] of that slot, so rows of
   several tokens (verification, short chunks) work as long as their tokens come in position order.
   ws: bf16 scratch of T * (QKV + NH*D + I) + nthreads * T * H; fs: fp32 scratch of T * (QKV + 2I + H)
   + nthreads * G * (max pos + 1). */
void decode_forward_bf16(uint16_t* x, int64_t T, const uint16_t* const* lw, const int64_t* windows, int64_t L,
                         const uint16_t* final_norm, float eps, const uint16_t* cos, const uint16_t* sin,
                         const int64_t* slots, const int64_t* pos, int64_t H, int64_t NH, int64_t NKV, int64_t D,
                         int64_t I, int64_t c_ss, int64_t c_sh, uint16_t* ws, float* fs, int nthreads) {
    const int64_t G = NH / NKV, NHEADS = NH + 2 * NKV, QKV = NHEADS * D, half = D / 2;
    const float scale = 1.f / sqrtf((float)D);
    int64_t maxctx = 1;
    for (int64_t t = 0; t < T; t++) if (pos[t] + 1 > maxctx) maxctx = pos[t] + 1;
    uint16_t* qkv = ws;                 /* (T, QKV) */
    uint16_t* attn = qkv + T * QKV;     /* (T, NH*D) */
    uint16_t* act = attn + T * NH * D;  /* (T, I) */
    uint16_t* priv = act + T * I;       /* per thread (T, H): normed input */
    float* yq = fs;                     /* (T, QKV) */
    float* yg = yq + T * QKV;           /* (T, 2I) */
    float* yh = yg + T * 2 * I;         /* (T, H) */
    float* sc_all = yh + T * H;         /* per thread G * maxctx */
    int nt = nthreads < 1 ? 1 : nthreads;
    _Pragma("omp parallel num_threads(nt)")
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        uint16_t* h = priv + (int64_t)tid * T * H;
        float* sc = sc_all + (int64_t)tid * G * maxctx;
        int64_t hlo, hhi, olo, ohi, ilo, ihi, alo, ahi;
        df_share(NHEADS, 1, tid, nth, &hlo, &hhi);
        df_share(H, 16, tid, nth, &olo, &ohi);
        df_share(I, 16, tid, nth, &ilo, &ihi);
        df_share(T * NKV, 1, tid, nth, &alo, &ahi);
        for (int64_t l = 0; l < L; l++) {
            const uint16_t* const* p = lw + l * 12;
            const uint16_t *in_norm = p[0], *qkv_w = p[1], *qkv_b = p[2], *o_w = p[3], *o_b = p[4];
            const uint16_t *post_norm = p[5], *gu_w = p[6], *gu_b = p[7], *dn_w = p[8], *dn_b = p[9];
            uint16_t *kc = (uint16_t*)p[10], *vc = (uint16_t*)p[11];
            /* 1. q/k/v of this thread's heads; RoPE on q and k; K and V into the cache. */
            df_rmsnorm(x, in_norm, eps, h, T, H);
            df_gemv(h, T, qkv_w, H, hlo * D, hhi * D, yq, QKV);
            for (int64_t t = 0; t < T; t++) {
                const uint16_t* cr = cos + t * D;
                const uint16_t* sr = sin + t * D;
                for (int64_t hd = hlo; hd < hhi; hd++) {
                    uint16_t* o = qkv + t * QKV + hd * D;
                    const float* y = yq + t * QKV + hd * D;
                    for (int64_t d = 0; d < D; d++) o[d] = f2bf(y[d] + (qkv_b ? bf2f(qkv_b[hd * D + d]) : 0.f));
                    if (hd < NH + NKV) {
                        for (int64_t d = 0; d < half; d++) {
                            float a = bf2f(o[d]), b = bf2f(o[d + half]);
                            o[d] = f2bf(R_bf16(R_bf16(a * bf2f(cr[d])) + R_bf16(-b * bf2f(sr[d]))));
                            o[d + half] = f2bf(R_bf16(R_bf16(b * bf2f(cr[d + half])) + R_bf16(a * bf2f(sr[d + half]))));
                        }
                    }
                    if (hd >= NH) {
                        int64_t kv = hd < NH + NKV ? hd - NH : hd - NH - NKV;
                        uint16_t* c = (hd < NH + NKV ? kc : vc) + slots[t] * c_ss + kv * c_sh + pos[t] * D;
                        memcpy(c, o, sizeof(uint16_t) * D);
                    }
                }
            }
            _Pragma("omp barrier")
            /* 2. Attention, one (token, KV head) item at a time. */
            for (int64_t it = alo; it < ahi; it++) {
                int64_t t = it / NKV, kv = it % NKV, ps = pos[t];
                int64_t lo = (windows[l] > 0 && ps - windows[l] + 1 > 0) ? ps - windows[l] + 1 : 0;
                const uint16_t* kb = kc + slots[t] * c_ss + kv * c_sh + lo * D;
                const uint16_t* vb = vc + slots[t] * c_ss + kv * c_sh + lo * D;
                const uint16_t* qr = qkv + t * QKV + kv * G * D;
                uint16_t* o = attn + t * NH * D + kv * G * D;
                if (D == 64) item_bf16_64(qr, D, kb, vb, ps + 1 - lo, G, D, scale, sc, o);
                else if (D == 128) item_bf16_128(qr, D, kb, vb, ps + 1 - lo, G, D, scale, sc, o);
                else item_bf16_any(qr, D, kb, vb, ps + 1 - lo, G, D, scale, sc, o);
            }
            _Pragma("omp barrier")
            /* 3. Output projection and the residual add, this thread's columns of x. */
            df_gemv(attn, T, o_w, NH * D, olo, ohi, yh, H);
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = olo; c < ohi; c++) {
                    float o = R_bf16(yh[t * H + c] + (o_b ? bf2f(o_b[c]) : 0.f));
                    x[t * H + c] = f2bf(bf2f(x[t * H + c]) + o);
                }
            _Pragma("omp barrier")
            /* 4. gate and up rows of this thread's intermediate units, then silu(gate) * up. */
            df_rmsnorm(x, post_norm, eps, h, T, H);
            df_gemv(h, T, gu_w, H, ilo, ihi, yg, 2 * I);
            df_gemv(h, T, gu_w, H, I + ilo, I + ihi, yg, 2 * I);
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = ilo; c < ihi; c++) {
                    float g = R_bf16(yg[t * 2 * I + c] + (gu_b ? bf2f(gu_b[c]) : 0.f));
                    float u = R_bf16(yg[t * 2 * I + I + c] + (gu_b ? bf2f(gu_b[I + c]) : 0.f));
                    act[t * I + c] = f2bf(R_bf16(g / (1.f + expf(-g))) * u);
                }
            _Pragma("omp barrier")
            /* 5. Down projection and the residual add. */
            df_gemv(act, T, dn_w, I, olo, ohi, yh, H);
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = olo; c < ohi; c++) {
                    float d = R_bf16(yh[t * H + c] + (dn_b ? bf2f(dn_b[c]) : 0.f));
                    x[t * H + c] = f2bf(d + bf2f(x[t * H + c]));
                }
            _Pragma("omp barrier")
        }
        if (tid == 0) {
            df_rmsnorm(x, final_norm, eps, h, T, H);
            memcpy(x, h, sizeof(uint16_t) * T * H);
        }
    }
}
#else
int decode_forward_available(void) { return 0; }
#endif
"""
