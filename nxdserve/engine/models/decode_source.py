"""C source of the fused bf16 decoder forward (compiled with the other kernels in ``cpu_kernels``).

Layer by layer, a forward is about ten framework calls per layer, each an OpenMP fork and join; between
them the second core sleeps and the Python in between runs on one. At a few tokens that is most of a
step, and at 32 tokens it is still a fifth of it (measured: ~7 ms of a 37 ms batch-32 step, plus the
other thread's wake-up latency before each GEMM). ``decode_forward_bf16`` runs every layer for up to
``fused_decode.MAX_TOKENS`` tokens inside ONE parallel region: each thread owns a fixed run of every
weight's panels (``gemm_source``: the same packed copy ``linear`` uses), threads meet at barriers
between the phases, and attention goes by (token, KV head) items, dynamically shared.

Rows may be decodes, verification rows or prefill chunks alike: every token writes its K/V at
(slot, position) before any token attends, then attends to keys lo..pos of its slot, so a row's tokens
see each other causally.

Rounding follows the eager bf16 layer: every projection's output, residual sum, RMSNorm output, RoPE
product and activation is rounded to bf16 where torch rounds it, and the GEMMs give oneDNN's bits, so
results match the layer-by-layer path (fp32 models never use this path).

Built only where the compiler targets AVX512-BF16 (``decode_forward_available()`` says so).
"""

SOURCE = r"""
#if defined(__AVX512BF16__) && defined(__AVX512F__)

int decode_forward_available(void) { return 1; }

/* Share [lo, hi) of n items for thread tid of nt. */
static inline void df_share(int64_t n, int tid, int nt, int64_t* lo, int64_t* hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}

/* out rows [t0, t1) = w * bf16(x * rsqrt(mean(x^2) + eps)), as add_rmsnorm_bf16 without the residual. */
static void df_rmsnorm(const uint16_t* x, const uint16_t* w, float eps, uint16_t* out, int64_t t0, int64_t t1,
                       int64_t H) {
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t* xr = x + t * H;
        float ss = 0.f;
        for (int64_t c = 0; c < H; c++) { float h = bf2f(xr[c]); ss += h * h; }
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t c = 0; c < H; c++) out[t * H + c] = f2bf(bf2f(w[c]) * R_bf16(bf2f(xr[c]) * inv));
    }
}

/* lane j of the result = sum of v[j]'s 16 lanes (a 16 x 16 transpose-and-add in 46 shuffles and adds). */
static inline __m512 df_sum16(const __m512* v) {
    __m512 s[8], t[4];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
    __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
    __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23))));
    /* lane 4q + i now holds v[q + 4i] */
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, r);
}

/* One (token, KV head) item for head size 64 and GG query heads per KV head (a compile-time count, so
   the output accumulators stay in registers): q . k as bf16 pair products summed in fp32 (exact
   products, like the fp32 loop), sixteen keys reduced together; softmax and p . v in fp32. */
#define DF_ITEM64(GG)                                                                                  \
static void df_item64_##GG(const uint16_t* q, const uint16_t* kb, const uint16_t* vb, int64_t n,         \
                           float scale, float* sc, uint16_t* o) {                                       \
    __m512bh qv[GG][2]; /* a zmm holds 32 bf16: half a row */                                          \
    for (int g = 0; g < GG; g++) {                                                                     \
        qv[g][0] = (__m512bh)_mm512_loadu_si512(q + g * 64);                                           \
        qv[g][1] = (__m512bh)_mm512_loadu_si512(q + g * 64 + 32);                                      \
    }                                                                                                  \
    for (int64_t j0 = 0; j0 < n; j0 += 16) {                                                           \
        int64_t nb = n - j0 < 16 ? n - j0 : 16;                                                        \
        __m512 part[GG][16];                                                                           \
        for (int64_t j = 0; j < 16; j++) {                                                             \
            if (j < nb) {                                                                              \
                const uint16_t* kr = kb + (j0 + j) * 64;                                               \
                __builtin_prefetch(kr + 16 * 64);                                                      \
                __builtin_prefetch((const char*)(kr + 16 * 64) + 64);                                  \
                __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr), k1 = (__m512bh)_mm512_loadu_si512(kr + 32); \
                for (int g = 0; g < GG; g++)                                                           \
                    part[g][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0), qv[g][1], k1); \
            } else {                                                                                   \
                for (int g = 0; g < GG; g++) part[g][j] = _mm512_setzero_ps();                         \
            }                                                                                          \
        }                                                                                              \
        __mmask16 m = nb == 16 ? (__mmask16)0xffff : (__mmask16)((1u << nb) - 1);                      \
        for (int g = 0; g < GG; g++)                                                                   \
            _mm512_mask_storeu_ps(sc + g * n + j0, m, _mm512_mul_ps(df_sum16(part[g]), _mm512_set1_ps(scale))); \
    }                                                                                                  \
    float inv[GG];                                                                                     \
    for (int g = 0; g < GG; g++) {                                                                     \
        float* sg = sc + g * n;                                                                        \
        float mx = sg[0];                                                                              \
        for (int64_t j = 1; j < n; j++) mx = fmaxf(mx, sg[j]);                                         \
        float sum = 0.f;                                                                               \
        /* p rounded to bf16 (p . v runs on bf16 pairs, as bf16 flash attention does); the sum is of the   \
           rounded weights, so they still sum to one. */                                               \
        for (int64_t j = 0; j < n; j++) { float e = R_bf16(expf(sg[j] - mx)); sg[j] = e; sum += e; }   \
        inv[g] = 1.f / sum;                                                                            \
    }                                                                                                  \
    /* p . v two keys at a time: their V rows interleaved into bf16 pairs, (p_j, p_j+1) broadcast, so  \
       one vdpbf16ps does two keys for 16 dims. Accumulator lane 4q + r of vector c holds dim          \
       32 * (c / 2) + 8q + 4 * (c % 2) + r (unpack works within 128-bit lanes); undone at the end. */ \
    __m512 acc[GG][4];                                                                                 \
    for (int g = 0; g < GG; g++)                                                                       \
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();                                   \
    for (int64_t j = 0; j < n; j += 2) {                                                               \
        const uint16_t* v0 = vb + j * 64;                                                              \
        __builtin_prefetch(v0 + 16 * 64);                                                              \
        __builtin_prefetch((const char*)(v0 + 16 * 64) + 64);                                          \
        int two = j + 1 < n;                                                                           \
        __m512i a0 = _mm512_loadu_si512(v0), a1 = _mm512_loadu_si512(v0 + 32);                         \
        __m512i b0 = two ? _mm512_loadu_si512(v0 + 64) : _mm512_setzero_si512();                       \
        __m512i b1 = two ? _mm512_loadu_si512(v0 + 96) : _mm512_setzero_si512();                       \
        __m512bh i[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0), \
                         (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)}; \
        for (int g = 0; g < GG; g++) {                                                                 \
            uint32_t pj, pk = 0;                                                                       \
            memcpy(&pj, sc + g * n + j, 4);                                                            \
            if (two) memcpy(&pk, sc + g * n + j + 1, 4);                                               \
            __m512bh pp = (__m512bh)_mm512_set1_epi32((int32_t)((pj >> 16) | (pk & 0xffff0000u)));     \
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pp, i[c]);             \
        }                                                                                              \
    }                                                                                                  \
    const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);       \
    const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8); \
    for (int g = 0; g < GG; g++) {                                                                     \
        __m512 scale_g = _mm512_set1_ps(inv[g]);                                                       \
        __m512 d[4] = {_mm512_permutex2var_ps(acc[g][0], lo, acc[g][1]),                               \
                       _mm512_permutex2var_ps(acc[g][0], hi, acc[g][1]),                               \
                       _mm512_permutex2var_ps(acc[g][2], lo, acc[g][3]),                               \
                       _mm512_permutex2var_ps(acc[g][2], hi, acc[g][3])};                              \
        for (int c = 0; c < 4; c++)                                                                    \
            _mm256_storeu_si256((__m256i*)(o + g * 64 + 16 * c), gm_round(_mm512_mul_ps(d[c], scale_g))); \
    }                                                                                                  \
}
DF_ITEM64(1) DF_ITEM64(2) DF_ITEM64(3) DF_ITEM64(4)

/* One thread's share of x (T, K) @ w^T (+ bias) (+ res) -> out, w packed (``gemm.pack``), N outputs. */
static inline void df_gemm(const uint16_t* x, int64_t T, int64_t K, const uint16_t* w, const uint16_t* b,
                           const uint16_t* res, int64_t N, uint16_t* out, int tid, int nth) {
    int64_t p0, p1;
    gm_share((N + GM_NR - 1) / GM_NR, tid, nth, &p0, &p1);
    gm_panels(x, T, K, K, w, p0, p1, b, res, N, N, out, N);
}

/* Per layer, 10 pointers: input norm, qkv weight, qkv bias, o weight, o bias, post norm, gate_up weight,
   gate_up bias, down weight, down bias (weights packed, biases may be NULL); then the layer's K and V cache
   bases (slots, kv heads, max_len, D) as two more pointers; windows[l] > 0 for a sliding window.
   x (T, H): the embeddings in, the final-norm hidden states out. cos/sin (T, D): the tokens' RoPE rows.
   Token t writes its K/V at (slots[t], pos[t]) and attends to keys lo..pos[t] of that slot.
   ws: bf16 scratch of T * (H + QKV + NH*D + 3I); fs: fp32 scratch of nthreads * G * (max pos + 1). */
void decode_forward_bf16(uint16_t* x, int64_t T, const uint16_t* const* lw, const int64_t* windows, int64_t L,
                         const uint16_t* final_norm, float eps, const uint16_t* cos, const uint16_t* sin,
                         const int64_t* slots, const int64_t* pos, int64_t H, int64_t NH, int64_t NKV, int64_t D,
                         int64_t I, int64_t c_ss, int64_t c_sh, uint16_t* ws, float* fs, int nthreads) {
    const int64_t G = NH / NKV, NHEADS = NH + 2 * NKV, QKV = NHEADS * D, half = D / 2;
    const float scale = 1.f / sqrtf((float)D);
    int64_t maxctx = 1;
    for (int64_t t = 0; t < T; t++) if (pos[t] + 1 > maxctx) maxctx = pos[t] + 1;
    uint16_t* h = ws;                   /* (T, H): normed input */
    uint16_t* qkv = h + T * H;          /* (T, QKV) */
    uint16_t* attn = qkv + T * QKV;     /* (T, NH*D) */
    uint16_t* gu = attn + T * NH * D;   /* (T, 2I) */
    uint16_t* act = gu + T * 2 * I;     /* (T, I) */
    int nt = nthreads < 1 ? 1 : nthreads;
    _Pragma("omp parallel num_threads(nt)")
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        float* sc = fs + (int64_t)tid * G * maxctx;
        int64_t tlo, thi;
        df_share(T, tid, nth, &tlo, &thi);
        for (int64_t l = 0; l < L; l++) {
            const uint16_t* const* p = lw + l * 12;
            const uint16_t *in_norm = p[0], *qkv_w = p[1], *qkv_b = p[2], *o_w = p[3], *o_b = p[4];
            const uint16_t *post_norm = p[5], *gu_w = p[6], *gu_b = p[7], *dn_w = p[8], *dn_b = p[9];
            uint16_t *kc = (uint16_t*)p[10], *vc = (uint16_t*)p[11];
            /* 1. Input norm of this thread's rows; q/k/v of this thread's panels. */
            df_rmsnorm(x, in_norm, eps, h, tlo, thi, H);
            _Pragma("omp barrier")
            df_gemm(h, T, H, qkv_w, qkv_b, NULL, QKV, qkv, tid, nth);
            _Pragma("omp barrier")
            /* 2. RoPE on q and k heads, K and V into the cache: (token, head) items. */
            _Pragma("omp for schedule(static)")
            for (int64_t it = 0; it < T * NHEADS; it++) {
                int64_t t = it / NHEADS, hd = it % NHEADS;
                uint16_t* o = qkv + t * QKV + hd * D;
                if (hd < NH + NKV) {
                    const uint16_t* cr = cos + t * D;
                    const uint16_t* sr = sin + t * D;
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
            /* 3. Attention, one (token, KV head) item at a time; items differ in length, so shared dynamically. */
            _Pragma("omp for schedule(dynamic, 2)")
            for (int64_t it = 0; it < T * NKV; it++) {
                int64_t t = it / NKV, kv = it % NKV, ps = pos[t];
                int64_t lo = (windows[l] > 0 && ps - windows[l] + 1 > 0) ? ps - windows[l] + 1 : 0;
                const uint16_t* kb = kc + slots[t] * c_ss + kv * c_sh + lo * D;
                const uint16_t* vb = vc + slots[t] * c_ss + kv * c_sh + lo * D;
                const uint16_t* qr = qkv + t * QKV + kv * G * D;
                uint16_t* o = attn + t * NH * D + kv * G * D;
                if (D == 64 && G == 1) df_item64_1(qr, kb, vb, ps + 1 - lo, scale, sc, o);
                else if (D == 64 && G == 2) df_item64_2(qr, kb, vb, ps + 1 - lo, scale, sc, o);
                else if (D == 64 && G == 3) df_item64_3(qr, kb, vb, ps + 1 - lo, scale, sc, o);
                else if (D == 64 && G == 4) df_item64_4(qr, kb, vb, ps + 1 - lo, scale, sc, o);
                else if (D == 64) item_bf16_64(qr, D, kb, vb, ps + 1 - lo, G, D, scale, sc, o);
                else if (D == 128) item_bf16_128(qr, D, kb, vb, ps + 1 - lo, G, D, scale, sc, o);
                else item_bf16_any(qr, D, kb, vb, ps + 1 - lo, G, D, scale, sc, o);
            }
            /* 4. Output projection plus the residual, in place on x (this thread's columns). */
            df_gemm(attn, T, NH * D, o_w, o_b, x, H, x, tid, nth);
            _Pragma("omp barrier")
            /* 5. Post-attention norm; gate and up; silu(gate) * up. */
            df_rmsnorm(x, post_norm, eps, h, tlo, thi, H);
            _Pragma("omp barrier")
            df_gemm(h, T, H, gu_w, gu_b, NULL, 2 * I, gu, tid, nth);
            _Pragma("omp barrier")
            for (int64_t t = tlo; t < thi; t++)
                for (int64_t c = 0; c < I; c++) {
                    float g = bf2f(gu[t * 2 * I + c]), u = bf2f(gu[t * 2 * I + I + c]);
                    act[t * I + c] = f2bf(R_bf16(g / (1.f + expf(-g))) * u);
                }
            _Pragma("omp barrier")
            /* 6. Down projection plus the residual, in place on x. */
            df_gemm(act, T, I, dn_w, dn_b, x, H, x, tid, nth);
            _Pragma("omp barrier")
        }
        df_rmsnorm(x, final_norm, eps, h, tlo, thi, H);
        _Pragma("omp barrier")
        for (int64_t t = tlo; t < thi; t++) memcpy(x + t * H, h + t * H, sizeof(uint16_t) * H);
    }
}
#else
int decode_forward_available(void) { return 0; }
#endif
"""
