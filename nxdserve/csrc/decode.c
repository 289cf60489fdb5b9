/* The fused bf16 decoder forward (part of kernels.c).

   Layer by layer, a forward is about ten framework calls per layer, each an OpenMP fork and join; between
   them the second core sleeps and the Python in between runs on one. At a few tokens that is most of a
   step, and at 32 tokens it is still a fifth of it (measured: ~7 ms of a 37 ms batch-32 step, plus the
   other thread's wake-up latency before each GEMM). ``decode_forward_bf16`` runs every layer for up to
   ``fused_decode.MAX_TOKENS`` tokens inside ONE parallel region: each thread owns a fixed run of every
   weight's panels (gemm.c: the same packed copy ``linear`` uses), threads meet at barriers
   between the phases, and attention goes by (block, KV head) items, dynamically shared, largest first.
   A block is a run of up to 8 tokens of one row (a prefill chunk; rows of 9+ tokens): its query rows share
   each key and value read, and K is transposed per 16 keys so q . k needs no horizontal sums. Measured
   (one core, 8 tokens x 3 heads): 1.66x the single-token items at 1400 keys, 1.7x at 100; in a 96-token
   step with a 72-token chunk at position 1380, attention went from 34 to 23.5 ms. Where the GEMMs run on AMX
   tiles, so do a block's q . k and p . v (``df_block64_amx``): eight 1000-token prompts prefilled in 0.67x the
   time, where the AVX512 blocks had become the largest piece of a long prompt (48% of it, against the AMX
   projections' 40%).

   Rows may be decodes, verification rows or prefill chunks alike: every token writes its K/V at
   (slot, position) before any token attends, then attends to keys lo..pos of its slot, so a row's tokens
   see each other causally.

   Rounding follows the eager bf16 layer: every projection's output, residual sum, RMSNorm output, RoPE
   product and activation is rounded to bf16 where torch rounds it, the GEMMs give oneDNN's bits, and the
   activation is torch's own silu, looked up (``df_silu_mul``); attention sums in its own order, so results are
   as close to fp32 as the layer-by-layer path's, not bit-equal to them (fp32 models never use this path).
   With ``keep``, the last layer finishes only the tokens whose states are read (the sampled ones).

   Built only where the compiler targets AVX512-BF16 (``decode_forward_available()`` says so). */

#if defined(__AVX512BF16__) && defined(__AVX512F__)

int decode_forward_available(void) { return 1; }

#define DF_BLOCK_TOKENS 8 /* tokens per block item */
#define DF_BLOCK_ROWS (DF_BLOCK_TOKENS * 4) /* blocks run for up to 4 query heads per KV head */
/* Runs (a row's consecutive tokens) shorter than this attend token by token (the single-token item). A block
   sums in another order than the item, so a verification row's tokens would get other bits than the same
   tokens decoded one per step; as items they get the same, and greedy bf16 output with speculation is then
   byte-identical to plain decoding (measured: 6 of 32 chat/grounded requests differed within 64 tokens with
   n-gram drafting, 11 of 32 with EAGLE k=3 plus 2 alternatives, all at logit gaps of 0-2 bf16 ulps; 0 of 32
   with this rule). Items cost 0.5-2% of a 4-token-row step at 200 keys, 3-4% at 6 tokens; runs of 9 or more
   (prefill chunks; drafts of k >= 8) keep the blocks' speed. Settable for A/B measurements and tests. */
static int64_t df_block_min_tokens = DF_BLOCK_TOKENS + 1;
void decode_forward_set_block_min(int64_t n) { df_block_min_tokens = n; }
int64_t decode_forward_block_min(void) { return df_block_min_tokens; }

/* Keys of a thread's next attention item pulled into L2 while it runs this one (16 KB of K at head size 64). */
#define DF_PREFETCH_KEYS 128

typedef struct { int64_t next; uint64_t ends; char pad[48]; } __attribute__((aligned(64))) df_claim;

/* The next attention item from the front of [lo, hi) (the costliest left) or, back, from its end (the
   cheapest): -1 when none is left. ends = lo << 32 | hi, taken by compare-and-swap. */
static inline int64_t df_claim_item(df_claim* c, int back) {
    uint64_t v = __atomic_load_n(&c->ends, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t lo = v >> 32, hi = v & 0xffffffffu;
        if (lo >= hi) return -1;
        const uint64_t want = back ? (lo << 32) | (hi - 1) : ((lo + 1) << 32) | hi;
        if (__atomic_compare_exchange_n(&c->ends, &v, want, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return back ? (int64_t)hi - 1 : (int64_t)lo;
    }
}

/* RoPE on one head's first half & ~15 pairs, 16 at a time: (a, b) = (o[d], o[d + half]) ->
   (bf16(bf16(a c) - bf16(b s)), bf16(bf16(b c') + bf16(a s'))), the eager layer's roundings (x + -y is x - y). */
static inline void df_rope16(uint16_t* o, const uint16_t* cr, const uint16_t* sr, int64_t half) {
    for (int64_t d = 0; d + 16 <= half; d += 16) {
        __m512 a = gm_widen(_mm256_loadu_si256((const __m256i*)(o + d)));
        __m512 b = gm_widen(_mm256_loadu_si256((const __m256i*)(o + half + d)));
        __m512 c0 = gm_widen(_mm256_loadu_si256((const __m256i*)(cr + d)));
        __m512 s0 = gm_widen(_mm256_loadu_si256((const __m256i*)(sr + d)));
        __m512 c1 = gm_widen(_mm256_loadu_si256((const __m256i*)(cr + half + d)));
        __m512 s1 = gm_widen(_mm256_loadu_si256((const __m256i*)(sr + half + d)));
        __m512 ac = gm_widen(gm_round(_mm512_mul_ps(a, c0))), bs = gm_widen(gm_round(_mm512_mul_ps(b, s0)));
        __m512 bc = gm_widen(gm_round(_mm512_mul_ps(b, c1))), as = gm_widen(gm_round(_mm512_mul_ps(a, s1)));
        _mm256_storeu_si256((__m256i*)(o + d), gm_round(_mm512_sub_ps(ac, bs)));
        _mm256_storeu_si256((__m256i*)(o + half + d), gm_round(_mm512_add_ps(bc, as)));
    }
}

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

/* fp8 codes to bf16 values, 32 at a time in integer arithmetic (exact: a code has at most four significant bits):
   a normal code's exponent and mantissa bits shifted to bf16's places plus the difference of the biases (e4m3fn:
   3 mantissa bits, bias 7; e5m2: 2 bits, bias 15), the subnormal codes (exponent field 0: 7 of them in e4m3fn, 3 in
   e5m2) looked up, the sign (sign-extended into bit 15) or-ed in. vcvtph2ps per 16 codes, then truncating the
   fp32, ran at 0.4x this speed. */
typedef struct { __m512i mag_mask, sign_mask, bias, first_normal, table, shift; } df_fp8_consts;

static inline df_fp8_consts df_fp8_setup(int kv_fp8) {
    const int e5m2 = kv_fp8 == 2;
    uint16_t sub[32] __attribute__((aligned(64))) = {0}; /* bf16 bits of m * 2^-9 (e4m3fn), m * 2^-16 (e5m2) */
    for (int m = 1; m < (e5m2 ? 4 : 8); m++) {
        union { float f; uint32_t u; } v = {(float)m * (e5m2 ? 0x1p-16f : 0x1p-9f)};
        sub[m] = (uint16_t)(v.u >> 16);
    }
    df_fp8_consts f = {_mm512_set1_epi16(0x7F), _mm512_set1_epi16((short)0x8000),
                       _mm512_set1_epi16(e5m2 ? 112 << 7 : 120 << 7), _mm512_set1_epi16(e5m2 ? 4 : 8),
                       _mm512_load_si512(sub), _mm512_set1_epi16(e5m2 ? 5 : 4)};
    return f;
}

static inline __m512i df_fp8_convert(__m512i c, const df_fp8_consts* f) {
    const __m512i mag = _mm512_and_si512(c, f->mag_mask);
    __m512i v = _mm512_add_epi16(_mm512_sllv_epi16(mag, f->shift), f->bias);
    v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, f->first_normal), mag, f->table);
    return _mm512_ternarylogic_epi32(v, c, f->sign_mask, 0xF8); /* v | (c & sign) */
}

static inline __m512i df_fp8_32(const uint8_t* p, const df_fp8_consts* f) {
    return df_fp8_convert(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)), f);
}

/* V rows v0 and v0 + 64 (zeros for the second when !two) interleaved into bf16 pairs for p . v: one
   vdpbf16ps with (p_j, p_j+1) broadcast then does two keys for 16 dims. Lane 4q + r of i[c] is dim
   32 * (c / 2) + 8q + 4 * (c % 2) + r (unpack works within 128-bit lanes); df_store_row undoes that. */
#define DF_V_PAIRS(NAME, T, LOAD32)                                                                     \
static inline void NAME(const T* v0, int two, __m512bh* i, const df_fp8_consts* fl) {                  \
    (void)fl;                                                                                           \
    __m512i a0 = LOAD32(v0), a1 = LOAD32(v0 + 32);                                                      \
    __m512i b0 = two ? LOAD32(v0 + 64) : _mm512_setzero_si512();                                        \
    __m512i b1 = two ? LOAD32(v0 + 96) : _mm512_setzero_si512();                                        \
    i[0] = (__m512bh)_mm512_unpacklo_epi16(a0, b0);                                                    \
    i[1] = (__m512bh)_mm512_unpackhi_epi16(a0, b0);                                                    \
    i[2] = (__m512bh)_mm512_unpacklo_epi16(a1, b1);                                                    \
    i[3] = (__m512bh)_mm512_unpackhi_epi16(a1, b1);                                                    \
}
#define DF_LOAD_BF16(p) _mm512_loadu_si512(p)
#define DF_LOAD_FP8(p) df_fp8_32((p), fl)
DF_V_PAIRS(df_v_pairs_any, uint16_t, DF_LOAD_BF16)
DF_V_PAIRS(df_v_pairs_fp8, uint8_t, DF_LOAD_FP8)
static inline void df_v_pairs(const uint16_t* v0, int two, __m512bh* i) { df_v_pairs_any(v0, two, i, NULL); }

/* One query head's four p . v accumulators (lanes in df_v_pairs' order) -> o[0..63] = bf16(acc * inv). */
static inline void df_store_row(const __m512* acc, float inv, uint16_t* o) {
    const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    const __m512 scale = _mm512_set1_ps(inv);
    __m512 d[4] = {_mm512_permutex2var_ps(acc[0], lo, acc[1]), _mm512_permutex2var_ps(acc[0], hi, acc[1]),
                   _mm512_permutex2var_ps(acc[2], lo, acc[3]), _mm512_permutex2var_ps(acc[2], hi, acc[3])};
    for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i*)(o + 16 * c), gm_round(_mm512_mul_ps(d[c], scale)));
}

/* One (token, KV head) item for head size 64 and GG query heads per KV head (a compile-time count, so
   the output accumulators stay in registers): q . k as bf16 pair products summed in fp32 (exact
   products, like the fp32 loop), sixteen keys reduced together; softmax and p . v in fp32, the softmax
   sixteen keys at a time with df_exp (the scalar expf loop before it: attention 3.56-3.88 against 3.13-3.41 ms
   of a 32-row forward in four of five interleaved pairs, equal in the fifth). Instantiated after df_exp.
   An item reads ~13 KB of K then as much of V from DRAM, too short for the hardware prefetcher to ramp up
   (measured alone, one thread, 100 keys: 0.8 us with K and V in cache, 3-4.5 us cold). So q . k pulls this
   item's V rows into L2 as it goes, and p . v pulls in nk_lines cache lines from nk: the start of the
   thread's next item's K (NULL: none). */
/* fp8 items (df_item64_fp8_*) read the codes and widen them in registers as they go (df_fp8_32); their rows are
   64 bytes, and a line is read 128 rows (8 KB) ahead, as the scratch widening measured best. */
#define DF_ITEM64(GG) DF_ITEM64_KV(df_item64_##GG, GG, uint16_t, DF_LOAD_BF16, df_v_pairs_any, 16)
#define DF_ITEM64_FP8(GG) DF_ITEM64_KV(df_item64_fp8_##GG, GG, uint8_t, DF_LOAD_FP8, df_v_pairs_fp8, 128)
#define DF_ITEM64_KV(NAME, GG, KT, LOAD32, VPAIRS, AHEAD)                                               \
static void NAME(const uint16_t* q, const KT* kb, const KT* vb, int64_t n, float scale, float vs,       \
                 float* sc, uint16_t* o, const char* nk, int64_t nk_lines, const df_fp8_consts* f) {   \
    df_fp8_consts fc; /* a local copy: the stores to sc could alias *f, a vector type */               \
    if (f) fc = *f;                                                                                     \
    const df_fp8_consts* fl = &fc;                                                                      \
    (void)fl;                                                                                           \
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
                const KT* kr = kb + (j0 + j) * 64;                                                     \
                __builtin_prefetch(kr + AHEAD * 64);                                                   \
                __builtin_prefetch((const char*)(kr + AHEAD * 64) + 64);                               \
                _mm_prefetch((const char*)(vb + (j0 + j) * 64), _MM_HINT_T1);                          \
                _mm_prefetch((const char*)(vb + (j0 + j) * 64) + 64, _MM_HINT_T1);                     \
                __m512bh k0 = (__m512bh)LOAD32(kr), k1 = (__m512bh)LOAD32(kr + 32);                    \
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
        __m512 mv = _mm512_set1_ps(-3.0e38f), sv = _mm512_setzero_ps();                                \
        for (int64_t j = 0; j < n; j += 16) {                                                          \
            const __mmask16 m = df_mask16(n - j);                                                      \
            mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, sg + j));                      \
        }                                                                                              \
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));                                    \
        /* p rounded to bf16 (p . v runs on bf16 pairs, as bf16 flash attention does); the sum is of the   \
           rounded weights, so they still sum to one. */                                               \
        for (int64_t j = 0; j < n; j += 16) {                                                          \
            const __mmask16 m = df_mask16(n - j);                                                      \
            __m512 e = df_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + j), mx));                    \
            e = gm_widen(gm_round(e)); /* gemm.c's f2bf and its way back */                            \
            _mm512_mask_storeu_ps(sg + j, m, e);                                                       \
            sv = _mm512_mask_add_ps(sv, m, sv, e);                                                     \
        }                                                                                              \
        inv[g] = 1.f / _mm512_reduce_add_ps(sv);                                                       \
    }                                                                                                  \
    /* p . v two keys at a time (df_v_pairs), the weights' bf16 halves paired. */                    \
    __m512 acc[GG][4];                                                                                 \
    for (int g = 0; g < GG; g++)                                                                       \
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();                                   \
    const int64_t pairs = (n + 1) / 2;                                                                 \
    int64_t nk_due = 0; /* nk_lines spread evenly over the pairs (Bresenham) */                        \
    for (int64_t j = 0; j < n; j += 2) {                                                               \
        for (nk_due += nk_lines; nk_due >= pairs; nk_due -= pairs, nk += 64) _mm_prefetch(nk, _MM_HINT_T1); \
        const KT* v0 = vb + j * 64;                                                                    \
        int two = j + 1 < n;                                                                           \
        __m512bh i[4];                                                                                 \
        VPAIRS(v0, two, i, fl);                                                                        \
        for (int g = 0; g < GG; g++) {                                                                 \
            uint32_t pj, pk = 0;                                                                       \
            memcpy(&pj, sc + g * n + j, 4);                                                            \
            if (two) memcpy(&pk, sc + g * n + j + 1, 4);                                               \
            __m512bh pp = (__m512bh)_mm512_set1_epi32((int32_t)((pj >> 16) | (pk & 0xffff0000u)));     \
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pp, i[c]);             \
        }                                                                                              \
    }                                                                                                  \
    for (int g = 0; g < GG; g++) df_store_row(acc[g], inv[g] * vs, o + g * 64);                        \
}

/* In place: r[j] lane i <- r[i] lane j (a 16 x 16 transpose of 32-bit elements, 64 shuffles). */
static inline void df_transpose16(__m512i* r) {
    __m512i t[16], u[16];
    for (int q = 0; q < 4; q++) {
        t[4 * q + 0] = _mm512_unpacklo_epi32(r[4 * q], r[4 * q + 1]);
        t[4 * q + 1] = _mm512_unpackhi_epi32(r[4 * q], r[4 * q + 1]);
        t[4 * q + 2] = _mm512_unpacklo_epi32(r[4 * q + 2], r[4 * q + 3]);
        t[4 * q + 3] = _mm512_unpackhi_epi32(r[4 * q + 2], r[4 * q + 3]);
        u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    /* u[4q + c], 128-bit lane k: element 4k + c of rows 4q..4q+3 */
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[c + 8] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[c + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

typedef uint32_t __attribute__((may_alias)) df_u32;

static inline __mmask16 df_mask16(int64_t k) {
    return k >= 16 ? (__mmask16)0xffff : k > 0 ? (__mmask16)((1u << k) - 1) : (__mmask16)0;
}

/* Row stride of a block's scores and weights: its keys rounded up to 32 (the softmax's step). */
static inline int64_t df_np(int64_t n) { return (n + 31) & ~(int64_t)31; }

/* fp8 KV cache (kv_fp8: 1 e4m3fn, 2 e5m2; ``--kv-cache-dtype``). A token's K/V are written as codes the way
   ``kv_quant.quantize`` casts them (fp8_code, attention.c), so every path stores the same codes for the same
   values. The head-size-64 single-token items read the codes themselves (df_item64_fp8); blocks and the other
   items widen their line's keys and values into the thread's scratch first (df_line) and run the bf16 code on
   them. K's scale is folded into the softmax scale and V's applied to the output. */
/* 16 values to codes, fp8_code's arithmetic across lanes (the tests hold both to torch's cast for every bf16
   value): normals round their mantissa in integers, nearest even; fp8 subnormals are y * 2^(bias + mbits - 1)
   (exact) rounded to an integer by the fp32 unit, nearest even, where 1 << mbits is the first normal code, as it
   should be. */
static inline __m128i df_fp8_code16(__m512 y, int kv_fp8) {
    const int e5m2 = kv_fp8 == 2, mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7, drop = 23 - mbits;
    const __m512i u = _mm512_castps_si512(y), one = _mm512_set1_epi32(1), shift = _mm512_set1_epi32(drop);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i m = _mm512_min_epu32(a, _mm512_set1_epi32(e5m2 ? 0x47600000 : 0x43E00000)); /* saturate */
    __m512i r = _mm512_add_epi32(m, _mm512_set1_epi32((1 << (drop - 1)) - 1));
    r = _mm512_add_epi32(r, _mm512_and_si512(_mm512_srlv_epi32(m, shift), one));
    r = _mm512_sub_epi32(_mm512_srlv_epi32(r, shift), _mm512_set1_epi32((127 - bias) << mbits));
    const __m512 up = _mm512_mul_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(e5m2 ? 0x1p16f : 0x1p9f));
    const __m512i sub = _mm512_cvt_roundps_epi32(up, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 normal = _mm512_cmpge_epu32_mask(m, _mm512_set1_epi32((128 - bias) << 23));
    __m512i c = _mm512_or_si512(_mm512_mask_blend_epi32(normal, sub, r), sign);
    c = _mm512_mask_or_epi32(c, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), sign,
                             _mm512_set1_epi32(0x7F)); /* NaN stays NaN */
    return _mm512_cvtepi32_epi8(c);
}

/* n bf16 values (a token's K or V row) to codes in dst, divided by the scale first unless it is 1. The division
   is an explicit-rounding instruction, so -ffast-math cannot make it a multiplication by the reciprocal (which
   gives another code for some values; fp8_quotient, attention.c). A 2000-token prompt writes 23M codes on
   SmolLM2: fp8_code one value at a time wrote 0.5 G codes/s a thread (45 ms a prompt), this writes 8.2 (3 ms);
   the prompt's prefill went from 0.87-0.91x a bf16 cache's speed to 0.95-0.98x. */
void decode_forward_fp8_store(uint8_t* dst, const uint16_t* src, int64_t n, int32_t kv_fp8, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = df_mask16(n - i);
        const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, src + i));
        __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        if (scale != 1.f) x = _mm512_div_round_ps(x, s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_mask_storeu_epi8(dst + i, k, df_fp8_code16(x, kv_fp8));
    }
}

/* A token's K or V row (D bf16 values) into a cache at element offset at: as it is, or as fp8 codes. */
static inline void df_put_row(uint16_t* cache, int64_t at, const uint16_t* row, int64_t D, int fp8, float s) {
    if (fp8) decode_forward_fp8_store((uint8_t*)cache + at, row, D, fp8, s);
    else memcpy(cache + at, row, sizeof(uint16_t) * (size_t)D);
}

#define DF_WIDEN_AHEAD 8192 /* bytes of codes read ahead */
/* n codes to bf16 values (df_fp8_convert) into dst. */
void decode_forward_fp8_widen(const uint8_t* src, uint16_t* dst, int64_t n, int32_t kv_fp8) {
    const df_fp8_consts f = df_fp8_setup(kv_fp8);
    for (int64_t i = 0; i < n; i += 32) {
        /* A line of ~64 KB (1000 keys of 64) is too short for the hardware prefetcher: without this the widening
           read 2.7 GB/s a thread from DRAM, where the bf16 items stream 9. */
        if (!(i & 63)) _mm_prefetch((const char*)src + i + DF_WIDEN_AHEAD, _MM_HINT_T0);
        const __mmask32 m = n - i >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (n - i)) - 1u);
        const __m512i c = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, src + i));
        _mm512_mask_storeu_epi16(dst + i, m, df_fp8_convert(c, &f));
    }
}

/* Keys first..n-1 of the (slot, KV head) line at element offset ``line`` as bf16 rows: the cache's own (*kb and
   *vb then point at key 0, and 0 is returned), or from an fp8 cache widened into w, 2 (n - first) D values
   (pointing at key first, which is returned). */
static inline int64_t df_line(const uint16_t* kc, const uint16_t* vc, int64_t line, int64_t first, int64_t n,
                              int64_t D, int fp8, uint16_t* w, const uint16_t** kb, const uint16_t** vb) {
    if (!fp8) { *kb = kc + line; *vb = vc + line; return 0; }
    const int64_t m = (n - first) * D;
    for (int64_t b = 0; b < DF_WIDEN_AHEAD && b < m; b += 64)
        _mm_prefetch((const char*)vc + line + first * D + b, _MM_HINT_T0);
    decode_forward_fp8_widen((const uint8_t*)kc + line + first * D, w, m, fp8);
    decode_forward_fp8_widen((const uint8_t*)vc + line + first * D, w + m, m, fp8);
    *kb = w; *vb = w + m;
    return first;
}

/* e^x to ~1e-6 relative (the result is rounded to bf16): 2^n * e^r with |r| <= ln2 / 2, a degree-5
   polynomial for e^r, ln 2 split in two for the reduction; scalef takes a very negative n to zero. */
static inline __m512 df_exp(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

DF_ITEM64(1) DF_ITEM64(2) DF_ITEM64(3) DF_ITEM64(4)
DF_ITEM64_FP8(1) DF_ITEM64_FP8(2) DF_ITEM64_FP8(3) DF_ITEM64_FP8(4)

/* out[c] = bf16(silu(g) * u) for n columns of gate g and up u, where silu(g) is the eager layer's bf16 silu,
   looked up: a bf16 gate has 65536 values, and ``tab`` holds torch's own silu of each (65537 entries, the
   last a pad for the 32-bit gather). So the activation has the eager layer's bits by construction; the
   product of two bf16 values is exact in fp32 and rounded once, as torch rounds it. (The expf loop before it
   differed from torch's silu on ~0.03% of gate values, and took 0.59-0.63 ms of a 32-row forward against
   0.40-0.45 for the lookup; 3.3-3.5 against 2.2-2.8 ms at 170 tokens.) */
static void df_silu_mul(const uint16_t* tab, const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = df_mask16(n - c);
        const __m512i gi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, g + c));
        const __m512i sv = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, gi, (const int*)tab, 2);
        const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(sv, 16)); /* the entry's 16 bits, widened */
        const __m512 p = _mm512_mul_round_ps(sf, gm_widen(_mm256_maskz_loadu_epi16(m, u + c)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_mask_storeu_epi16(out + c, m, gm_round(p));
    }
}

void decode_forward_silu_mul(const uint16_t* tab, const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
    df_silu_mul(tab, g, u, out, n);
}

/* Tokens of one row at consecutive positions (a prefill chunk or verification rows) share each key and
   value read across all their query rows: R = tokens x G rows, row r = (token r / G, head r % G) at
   qp[r], output at op[r]. Token i sees keys 0..n0 + i - 1 of kb/vb. Per 16 keys, K is transposed once
   into bf16 pairs per dimension pair, so q . k is 32 pair products per row with no horizontal sums (the
   single-token item needs a 16-way reduction per key); p . v goes on bf16 pairs as in the item.
   sc: R * np floats of scores, pb: R * np bf16 weights (np = df_np(keys)). */
/* 16 keys of head size 64 from k (nb of them, zeros after), transposed: kt[p] lane j holds dims 2p, 2p + 1 of
   key j (as bf16 pairs). */
static inline void df_keys_transposed(const uint16_t* k, int64_t nb, __m512i* kt) {
    for (int64_t j = 0; j < 16; j++) {
        kt[j] = j < nb ? _mm512_loadu_si512(k + j * 64) : _mm512_setzero_si512();
        kt[16 + j] = j < nb ? _mm512_loadu_si512(k + j * 64 + 32) : _mm512_setzero_si512();
    }
    df_transpose16(kt);
    df_transpose16(kt + 16);
}

/* A block's softmax: per row r (its keys: n0 + r / G) over its scores sc (row stride np); the weights rounded to
   bf16 (as in the item) into pb, zero past the row's keys up to np; inv[r] = 1 / their sum. */
static void df_block_softmax(const float* sc, uint16_t* pb, int64_t R, int64_t G, int64_t n0, int64_t np,
                             float* inv) {
    for (int64_t r = 0; r < R; r++) {
        const int64_t nr = n0 + r / G;
        const float* s = sc + r * np;
        uint16_t* w = pb + r * np;
        __m512 mv = _mm512_set1_ps(-3.0e38f), sv = _mm512_setzero_ps();
        for (int64_t j = 0; j < nr; j += 16) {
            __mmask16 m = df_mask16(nr - j);
            mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, s + j));
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        /* 32 weights at a time: one conversion to bf16 pairs, and their sum as a pair product with ones. */
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
        for (int64_t j = 0; j < np; j += 32) {
            __mmask16 m0 = df_mask16(nr - j), m1 = df_mask16(nr - j - 16);
            __m512 e0 = df_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m0, s + j), mx));
            __m512 e1 = df_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m1, s + j + 16), mx));
            __mmask32 m = (__mmask32)m0 | ((__mmask32)m1 << 16);
            __m512i e = _mm512_maskz_mov_epi16(m, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            _mm512_storeu_si512(w + j, e);
            sv = _mm512_dpbf16_ps(sv, (__m512bh)e, ones);
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(sv);
    }
}

static void df_block64(const uint16_t* const* qp, uint16_t* const* op, int64_t R, int64_t G, const uint16_t* kb,
                       const uint16_t* vb, int64_t n0, float scale, float vs, float* sc, uint16_t* pb) {
    const int64_t n = n0 + (R - 1) / G, np = df_np(n);
    float inv[DF_BLOCK_ROWS];
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t nb = n - j0 < 16 ? n - j0 : 16;
        __m512i kt[32];
        df_keys_transposed(kb + j0 * 64, nb, kt); /* kt[p] lane j: dims 2p, 2p + 1 of key j0 + j */
        for (int64_t r0 = 0; r0 < R; r0 += 8) {
            const df_u32* q[8];
            for (int r = 0; r < 8; r++) q[r] = (const df_u32*)qp[r0 + r < R ? r0 + r : R - 1];
            __m512 acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
            for (int p = 0; p < 32; p++) {
                __m512bh k = (__m512bh)kt[p];
                for (int r = 0; r < 8; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int32_t)q[r][p]), k);
            }
            for (int r = 0; r < 8 && r0 + r < R; r++)
                _mm512_storeu_ps(sc + (r0 + r) * np + j0, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
        }
    }
    df_block_softmax(sc, pb, R, G, n0, np, inv);
    /* p . v, six rows at a time (24 accumulators): a pair of V rows is interleaved once per six rows. */
    for (int64_t r0 = 0; r0 < R; r0 += 6) {
        const int64_t rm = R - r0 < 6 ? R - r0 : 6, ng = n0 + (r0 + rm - 1) / G;
        const df_u32* w[6];
        for (int r = 0; r < 6; r++) w[r] = (const df_u32*)(pb + (r0 + r < R ? r0 + r : R - 1) * np);
        __m512 acc[6][4];
        for (int r = 0; r < 6; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < ng; j += 2) {
            __m512bh i[4];
            df_v_pairs(vb + j * 64, j + 1 < ng, i);
            for (int r = 0; r < 6; r++) {
                __m512bh pp = (__m512bh)_mm512_set1_epi32((int32_t)w[r][j >> 1]);
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, i[c]);
            }
        }
        for (int64_t r = 0; r < rm; r++) df_store_row(acc[r], inv[r0 + r] * vs, op[r0 + r]);
    }
}

#ifdef GM_AMX
/* df_block64 on AMX tiles (where the GEMMs use them): q . k and p . v as tile products, the softmax between them
   unchanged. A row's sums still depend on that row alone (rows padded to 16 are zeros or ignored), so a kept
   token run as a block of one gets its bits from the full block, as df_block64's do. pb must have room for 32
   rows of weights (the tiles read whole 16-row groups; rows past R are not used). Tiles (gm_amx_config's
   shapes): q . k: C 0, A 1, B 2-3 (dims 0-31, 32-63); p . v: C 0-3 (the df_v_pairs lane groups), A 4, B 5. */
static void df_block64_amx(const uint16_t* const* qp, uint16_t* const* op, int64_t R, int64_t G, const uint16_t* kb,
                           const uint16_t* vb, int64_t n0, float scale, float vs, float* sc, uint16_t* pb) {
    const int64_t n = n0 + (R - 1) / G, np = df_np(n), RT = (R + 15) / 16;
    float inv[DF_BLOCK_ROWS];
    uint16_t qbuf[32 * 64] __attribute__((aligned(64)));
    uint16_t kbuf[32 * 32] __attribute__((aligned(64))); /* 32 dim pairs x 16 keys */
    uint16_t vbuf[4 * 16 * 32] __attribute__((aligned(64))); /* 4 lane groups x 16 key pairs x 16 x 2 */
    float cbuf[16 * 64] __attribute__((aligned(64)));
    for (int64_t r = 0; r < 16 * RT; r++) {
        if (r < R) memcpy(qbuf + r * 64, qp[r], 128);
        else memset(qbuf + r * 64, 0, 128);
    }
    gm_amx_config();
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t nb = n - j0 < 16 ? n - j0 : 16;
        __m512i kt[32];
        df_keys_transposed(kb + j0 * 64, nb, kt); /* kt[p]: row p of a B tile */
        for (int p = 0; p < 32; p++) _mm512_store_si512(kbuf + p * 32, kt[p]);
        _tile_loadd(2, kbuf, 64);
        _tile_loadd(3, kbuf + 16 * 32, 64);
        for (int64_t rt = 0; rt < RT; rt++) {
            _tile_zero(0);
            _tile_loadd(1, qbuf + rt * 16 * 64, 128);
            _tile_dpbf16ps(0, 1, 2);
            _tile_loadd(1, qbuf + rt * 16 * 64 + 32, 128);
            _tile_dpbf16ps(0, 1, 3);
            _tile_stored(0, cbuf, 64);
            for (int64_t r = 16 * rt; r < R && r < 16 * rt + 16; r++)
                _mm512_storeu_ps(sc + r * np + j0, _mm512_mul_ps(_mm512_load_ps(cbuf + (r - 16 * rt) * 16), sv));
        }
    }
    df_block_softmax(sc, pb, R, G, n0, np, inv);
    for (int64_t rt = 0; rt < RT; rt++) {
        const int64_t r1 = R < 16 * rt + 16 ? R : 16 * rt + 16, ng = n0 + (r1 - 1) / G;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j = 0; j < ng; j += 32) {
            for (int64_t k2 = 0; k2 < 16; k2++) {
                const int64_t key = j + 2 * k2;
                __m512bh i[4];
                if (key < ng) df_v_pairs(vb + key * 64, key + 1 < ng, i);
                else i[0] = i[1] = i[2] = i[3] = (__m512bh)_mm512_setzero_si512();
                for (int c = 0; c < 4; c++) _mm512_store_si512(vbuf + (c * 16 + k2) * 32, (__m512i)i[c]);
            }
            _tile_loadd(4, pb + rt * 16 * np + j, 2 * np);
            _tile_loadd(5, vbuf, 64); _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, vbuf + 16 * 32, 64); _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, vbuf + 32 * 32, 64); _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, vbuf + 48 * 32, 64); _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, cbuf, 256); _tile_stored(1, cbuf + 16, 256);
        _tile_stored(2, cbuf + 32, 256); _tile_stored(3, cbuf + 48, 256);
        for (int64_t r = 16 * rt; r < r1; r++) {
            const float* cr = cbuf + (r - 16 * rt) * 64;
            const __m512 acc[4] = {_mm512_load_ps(cr), _mm512_load_ps(cr + 16), _mm512_load_ps(cr + 32),
                                   _mm512_load_ps(cr + 48)};
            df_store_row(acc, inv[r] * vs, op[r]);
        }
    }
}
#endif

/* A block on the tiles where the GEMMs use them (gm_amx_on: the same switch, so one setting gives one
   machine's bits), else on AVX512-BF16. */
static inline void df_block(const uint16_t* const* qp, uint16_t* const* op, int64_t R, int64_t G, const uint16_t* kb,
                            const uint16_t* vb, int64_t n0, float scale, float vs, float* sc, uint16_t* pb) {
#ifdef GM_AMX
    if (gm_amx_on > 0) { df_block64_amx(qp, op, R, G, kb, vb, n0, scale, vs, sc, pb); return; }
#endif
    df_block64(qp, op, R, G, kb, vb, n0, scale, vs, sc, pb);
}

/* attention.c's items with the V scale applied (VS_FP8): the other head shapes on an fp8 cache's widened rows. */
DEFINE_ITEM_KV(item_bf16v_64, uint16_t, bf2f, f2bf, uint16_t, bf2f, ROWS_EACH, VS_FP8, 64, 64)
DEFINE_ITEM_KV(item_bf16v_128, uint16_t, bf2f, f2bf, uint16_t, bf2f, ROWS_EACH, VS_FP8, 128, 128)
DEFINE_ITEM_KV(item_bf16v_any, uint16_t, bf2f, f2bf, uint16_t, bf2f, ROWS_EACH, VS_FP8, D, MAXD)

/* The first key a token at ps sees: 0, or the start of its sliding window. */
static inline int64_t df_first_key(int64_t ps, int64_t window) {
    return (window > 0 && ps - window + 1 > 0) ? ps - window + 1 : 0;
}

/* One token's attention for one KV head: keys lo..ps (lo from the sliding window, if any) of kb/vb, whose first
   row is key ``first`` (df_line); scale: the softmax's (times K's fp8 scale), vs: V's fp8 scale (1: none). nk,
   nk_lines: cache lines for the head-size-64 items to pull into L2 meanwhile (df_item64). */
static void df_attend_one(const uint16_t* qr, const uint16_t* kb, const uint16_t* vb, int64_t first, int64_t ps,
                          int64_t window, int64_t G, int64_t D, float scale, float vs, float* sc, uint16_t* o,
                          const char* nk, int64_t nk_lines) {
    int64_t lo = df_first_key(ps, window);
    const uint16_t* kl = kb + (lo - first) * D;
    const uint16_t* vl = vb + (lo - first) * D;
    int64_t n = ps + 1 - lo;
    if (D == 64 && G == 1) df_item64_1(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, NULL);
    else if (D == 64 && G == 2) df_item64_2(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, NULL);
    else if (D == 64 && G == 3) df_item64_3(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, NULL);
    else if (D == 64 && G == 4) df_item64_4(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, NULL);
    else if (D == 64) (vs == 1.f ? item_bf16_64 : item_bf16v_64)(qr, D, kl, vl, n, G, D, scale, sc, o, vs);
    else if (D == 128) (vs == 1.f ? item_bf16_128 : item_bf16v_128)(qr, D, kl, vl, n, G, D, scale, sc, o, vs);
    else (vs == 1.f ? item_bf16_any : item_bf16v_any)(qr, D, kl, vl, n, G, D, scale, sc, o, vs);
}

/* df_attend_one straight on an fp8 line (head size 64, up to 4 query heads per KV head: df_item64_fp8), kb / vb
   the line's key 0. */
static void df_attend_one_fp8(const uint16_t* qr, const uint8_t* kb, const uint8_t* vb, int64_t ps, int64_t window,
                              int64_t G, float scale, float vs, float* sc, uint16_t* o, const char* nk,
                              int64_t nk_lines, const df_fp8_consts* f) {
    const int64_t lo = df_first_key(ps, window), n = ps + 1 - lo;
    const uint8_t *kl = kb + lo * 64, *vl = vb + lo * 64;
    if (G == 1) df_item64_fp8_1(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, f);
    else if (G == 2) df_item64_fp8_2(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, f);
    else if (G == 3) df_item64_fp8_3(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, f);
    else df_item64_fp8_4(qr, kl, vl, n, scale, vs, sc, o, nk, nk_lines, f);
}

/* fp32 scratch per thread: a block's scores (R rows) then its bf16 weights, with room for 32 rows of them
   (df_block64_amx), or the single-token items' scores; then, for an fp8 cache, a line's widened K and V. */
int64_t decode_forward_scratch(int64_t G, int64_t maxctx, int64_t D, int32_t kv_fp8) {
    int64_t block = (DF_BLOCK_TOKENS * G + DF_BLOCK_ROWS / 2) * df_np(maxctx);
    return (block > G * maxctx ? block : G * maxctx) + 16 + (kv_fp8 ? maxctx * D : 0);
}

/* One thread's share of x (T, K) @ w^T (+ bias) (+ res) -> out, w packed (``gemm.pack``), N outputs: panels
   stolen between threads (``gm_panels_steal``) when runs is set, else a static run of them. */
static inline void df_gemm(const uint16_t* x, int64_t T, int64_t K, const uint16_t* w, const uint8_t* cw,
                           const uint16_t* b, const uint16_t* res, int64_t N, uint16_t* out, gm_run* runs, int nruns,
                           int tid, int nth) {
    if (runs) {
        gm_panels_steal(x, T, K, K, w, cw, runs, tid, nruns, b, res, N, N, out, N);
        return;
    }
    int64_t p0, p1;
    gm_share((N + GM_NR - 1) / GM_NR, tid, nth, &p0, &p1);
    gm_panels(x, T, K, K, w, cw, p0, p1, b, res, N, N, out, N);
}

/* Pulls into L2 the first panel of this thread's static run of a packed weight (K inputs, N outputs): the panel
   a GEMM starts on cold, since only later panels are prefetched by the ones before them (gm_panel). Issued
   before the short phase (a norm, the activation) or the wait that precedes the GEMM. */
static inline void df_prefetch_first_panel(const uint16_t* w, const uint8_t* cw, int64_t K, int64_t N, int tid,
                                           int nth) {
    int64_t p0, p1;
    gm_share((N + GM_NR - 1) / GM_NR, tid, nth, &p0, &p1);
    if (p0 < p1) gm_prefetch_panel(w, cw, K, p0);
}

/* Per layer, 16 pointers: input norm, qkv weight, qkv bias, o weight, o bias, post norm, gate_up weight,
   gate_up bias, down weight, down bias (weights packed, biases may be NULL); then the layer's K and V cache
   bases (slots, kv heads, max_len, D) as two more pointers; then the four weights' compressed copies
   (``gemm.compress``, each NULL where there is none); windows[l] > 0 for a sliding window.
   x (T, H): the embeddings in, the final-norm hidden states out (final_norm NULL: the last layer's output).
   A NULL input-norm pointer in the table means no input norm (an EAGLE-1 head's layer).
   cos/sin (T, D): the tokens' RoPE rows.
   Token t writes its K/V at (slots[t], pos[t]) and attends to keys lo..pos[t] of that slot.
   The last A tokens are draft alternatives: each sees keys lo..pos[t] - 1 of its slot plus its own K/V, which
   it only borrows cache position pos[t] for (that position's K/V is put back after the layer's attention);
   their K/V go to alt_kv (L, A, 2, NKV, D) instead, for the caller to install if one is accepted.
   ws: bf16 scratch of T * (H + QKV + NH*D + 3I + 24); fs: fp32 scratch of nthreads *
   decode_forward_scratch(G, max pos + 1). silu_tab: torch's bf16 silu of every bf16 value (df_silu_mul).
   keep (K increasing token indices, no alternatives), or NULL: only these tokens' outputs are wanted (the
   sampled ones), so the last layer runs q/k/v for every token (the cache needs their K/V) and attention,
   o, the MLP and the final norm for these alone; their outputs are x's first K rows. A token keeps the
   attention kernel it would have had (item, or block of one), so its bits are what the full forward gives it. */
static void df_forward(uint16_t* x, int64_t T, const uint16_t* const* lw, const int64_t* windows, int64_t L,
                       const uint16_t* final_norm, float eps, const uint16_t* cos, const uint16_t* sin,
                       const int64_t* slots, const int64_t* pos, int64_t H, int64_t NH, int64_t NKV, int64_t D,
                       int64_t I, int64_t c_ss, int64_t c_sh, uint16_t* ws, float* fs, int64_t A,
                       uint16_t* alt_kv, int nthreads, const uint16_t* silu_tab, const int64_t* keep,
                       int64_t K, int fp8, const float* kv_scales) {
    const int64_t G = NH / NKV, NHEADS = NH + 2 * NKV, QKV = NHEADS * D, half = D / 2, TM = T - A;
    const float scale = 1.f / sqrtf((float)D);
    int64_t maxctx = 1;
    for (int64_t t = 0; t < T; t++) if (pos[t] + 1 > maxctx) maxctx = pos[t] + 1;
    uint16_t* h = ws;                   /* (T, H): normed input */
    uint16_t* qkv = h + T * H;          /* (T, QKV) */
    uint16_t* attn = qkv + T * QKV;     /* (T, NH*D) */
    uint16_t* gu = attn + T * NH * D;   /* (T, 2I) */
    uint16_t* act = gu + T * 2 * I;     /* (T, I) */
    /* Attention blocks: runs of up to DF_BLOCK_TOKENS tokens of one row (same slot, consecutive positions),
       largest first so that the dynamic schedule does not end on a long one. The table lives in the
       caller's scratch after act: 3T int64 (12T bf16 slots). */
    int64_t nblk = 0, *blk_t = (int64_t*)(act + T * I), *blk_n = blk_t + T, *blk_cost = blk_n + T;
    int64_t* tok_n = blk_cost + 3 * T; /* each token's block size, negative for items (after grp_a, grp_n) */
    for (int64_t t = 0; t < TM;) {
        int64_t r = t + 1; /* the whole run; a short one goes token by token (blk_n < 0: see df_block_min_tokens) */
        while (r < TM && slots[r] == slots[t] && pos[r] == pos[r - 1] + 1) r++;
        const int64_t itemize = r - t < df_block_min_tokens;
        for (; t < r;) {
            int64_t e = t + DF_BLOCK_TOKENS < r ? t + DF_BLOCK_TOKENS : r;
            int64_t b = nblk++, cost = (e - t) * (pos[e - 1] + 1);
            while (b > 0 && blk_cost[b - 1] < cost) {
                blk_t[b] = blk_t[b - 1]; blk_n[b] = blk_n[b - 1]; blk_cost[b] = blk_cost[b - 1]; b--;
            }
            blk_t[b] = t; blk_n[b] = itemize ? -(e - t) : e - t; blk_cost[b] = cost;
            for (int64_t u = t; u < e; u++) tok_n[u] = blk_n[b];
            t = e;
        }
    }
    /* Alternatives by slot: groups of consecutive alternatives of one row share the borrowed position. */
    int64_t ngrp = 0, *grp_a = blk_cost + T, *grp_n = grp_a + T;
    for (int64_t a = 0; a < A;) {
        int64_t e = a + 1;
        while (e < A && slots[TM + e] == slots[TM + a] && pos[TM + e] == pos[TM + a]) e++;
        grp_a[ngrp] = a; grp_n[ngrp++] = e - a;
        a = e;
    }
    const int prune = keep != NULL && A == 0 && K < T && L > 0;
    const int64_t per_thread = decode_forward_scratch(G, maxctx, D, fp8);
    const int64_t attention_scratch = decode_forward_scratch(G, maxctx, D, 0); /* then an fp8 line's rows */
    const int64_t esize = fp8 ? 1 : 2; /* bytes per cached element */
    int nt = nthreads < 1 ? 1 : nthreads;
    /* Panel runs for work stealing (gm_panels_steal): 4 GEMMs per layer x their row blocks x nt threads, set up
       here so that no thread needs a barrier to reset them. A pruned last layer's GEMMs use the first blocks. */
    const int64_t gk[4] = {H, NH * D, H, I}, gn[4] = {QKV, H, 2 * I, H};
    int64_t run_at[4], per_layer = 0;
    for (int j = 0; j < 4; j++) {
        run_at[j] = per_layer;
        per_layer += gm_blocks(T, gk[j]) * nt;
    }
    gm_run* runs = nt > 1 && gm_stealing ? (gm_run*)aligned_alloc(64, sizeof(gm_run) * L * per_layer) : NULL;
    /* Attention item counters, one per layer on its own cache line, zeroed here: no barrier resets them. */
    const int64_t nitems = nblk * NKV;
    df_claim claims[L > 0 ? L : 1];
    memset(claims, 0, sizeof(df_claim) * (L > 0 ? L : 1));
    for (int64_t l = 0; l < L; l++) claims[l].ends = (uint64_t)nitems;
    if (runs)
        for (int64_t l = 0; l < L; l++)
            for (int j = 0; j < 4; j++)
                gm_runs_init(runs + l * per_layer + run_at[j], T, gk[j], (gn[j] + GM_NR - 1) / GM_NR, nt);
    _Pragma("omp parallel num_threads(nt)")
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        /* Fewer threads than asked: runs of missing threads are still claimed by the others' stealing. */
        gm_run* lr[4];
        float* sc = fs + (int64_t)tid * per_thread;
        uint16_t* widened = (uint16_t*)(sc + attention_scratch);
        const df_fp8_consts fp8_consts = df_fp8_setup(fp8 ? fp8 : 1);
        const int direct = fp8 && D == 64 && G <= 4; /* single-token items read an fp8 line themselves */
        int64_t tlo, thi;
        df_share(T, tid, nth, &tlo, &thi);
        for (int64_t l = 0; l < L; l++) {
            const uint16_t* const* p = lw + l * 16;
            const uint16_t *in_norm = p[0], *qkv_w = p[1], *qkv_b = p[2], *o_w = p[3], *o_b = p[4];
            const uint16_t *post_norm = p[5], *gu_w = p[6], *gu_b = p[7], *dn_w = p[8], *dn_b = p[9];
            uint16_t *kc = (uint16_t*)p[10], *vc = (uint16_t*)p[11];
            const uint8_t *qkv_c = (const uint8_t*)p[12], *o_c = (const uint8_t*)p[13];
            const uint8_t *gu_c = (const uint8_t*)p[14], *dn_c = (const uint8_t*)p[15];
            for (int j = 0; j < 4; j++) lr[j] = runs ? runs + l * per_layer + run_at[j] : NULL;
            const int last = prune && l == L - 1;
            const int blocks = D == 64 && G <= 4 && windows[l] <= 0; /* df_block64's shapes */
            const float ks = fp8 ? kv_scales[2 * l] : 1.f, vs = fp8 ? kv_scales[2 * l + 1] : 1.f;
            /* 1. Input norm of this thread's rows (an EAGLE head may have none); q/k/v of its panels. */
            df_prefetch_first_panel(qkv_w, qkv_c, H, QKV, tid, nth);
            if (in_norm) df_rmsnorm(x, in_norm, eps, h, tlo, thi, H);
            else if (thi > tlo) memcpy(h + tlo * H, x + tlo * H, sizeof(uint16_t) * (thi - tlo) * H);
            _Pragma("omp barrier")
            df_gemm(h, T, H, qkv_w, qkv_c, qkv_b, NULL, QKV, qkv, lr[0], nt, tid, nth);
            _Pragma("omp barrier")
            /* 2. RoPE on q and k heads, K and V into the cache: (token, head) items. */
            _Pragma("omp for schedule(static)")
            for (int64_t it = 0; it < T * NHEADS; it++) {
                int64_t t = it / NHEADS, hd = it % NHEADS;
                uint16_t* o = qkv + t * QKV + hd * D;
                if (hd < NH + NKV) {
                    const uint16_t* cr = cos + t * D;
                    const uint16_t* sr = sin + t * D;
                    df_rope16(o, cr, sr, half);
                    for (int64_t d = half & ~(int64_t)15; d < half; d++) { /* what df_rope16 leaves */
                        float a = bf2f(o[d]), b = bf2f(o[d + half]);
                        o[d] = f2bf(R_bf16(R_bf16(a * bf2f(cr[d])) + R_bf16(-b * bf2f(sr[d]))));
                        o[d + half] = f2bf(R_bf16(R_bf16(b * bf2f(cr[d + half])) + R_bf16(a * bf2f(sr[d + half]))));
                    }
                }
                if (hd >= NH) {
                    const int64_t kv = hd < NH + NKV ? hd - NH : hd - NH - NKV, is_v = hd >= NH + NKV;
                    const int64_t at = slots[t] * c_ss + kv * c_sh + pos[t] * D; /* elements */
                    if (t >= TM) memcpy(alt_kv + ((l * A + t - TM) * 2 + is_v) * NKV * D + kv * D, o, 2 * D);
                    else df_put_row(is_v ? vc : kc, at, o, D, fp8, is_v ? vs : ks);
                }
            }
            /* 3. Attention by (block, KV head) items; they differ in size, so shared dynamically: each thread
               claims its next item before it runs this one, and a single-token item pulls the next one's first
               keys into L2 (a block is bound by its arithmetic; measured, prefetching there bought nothing).
               Items are sorted costliest first; even threads take them from the front, odd ones from the back,
               so in a step of prompts and decodes one core runs the prompts' blocks (arithmetic) while the
               other streams the decodes' K/V (memory) instead of both doing one kind, then the other. Measured
               on 2 x 70-token prompts + 30 decodes: the attention phase 6.4-6.5 vs 6.7-7.2 ms a step. */
            if (last) { /* (kept token, KV head) items: out to the token's compact row k */
                for (int64_t it = __atomic_fetch_add(&claims[l].next, 1, __ATOMIC_RELAXED); it < K * NKV;
                     it = __atomic_fetch_add(&claims[l].next, 1, __ATOMIC_RELAXED)) {
                    const int64_t k = it / NKV, kv = it % NKV, t = keep[k];
                    if (direct && !(tok_n[t] > 1 && blocks)) {
                        const int64_t line = slots[t] * c_ss + kv * c_sh;
                        df_attend_one_fp8(qkv + t * QKV + kv * G * D, (const uint8_t*)kc + line,
                                          (const uint8_t*)vc + line, pos[t], windows[l], G, scale * ks, vs, sc,
                                          attn + k * NH * D + kv * G * D, NULL, 0, &fp8_consts);
                        continue;
                    }
                    const uint16_t *kb, *vb;
                    const int64_t first = df_line(kc, vc, slots[t] * c_ss + kv * c_sh, df_first_key(pos[t], windows[l]),
                                                  pos[t] + 1, D, fp8, widened, &kb, &vb);
                    uint16_t* o = attn + k * NH * D + kv * G * D;
                    if (tok_n[t] > 1 && blocks) {
                        const uint16_t* qp[DF_BLOCK_ROWS];
                        uint16_t* op[DF_BLOCK_ROWS];
                        for (int64_t g = 0; g < G; g++) {
                            qp[g] = qkv + t * QKV + (kv * G + g) * D;
                            op[g] = o + g * D;
                        }
                        uint16_t* wb = (uint16_t*)(sc + G * df_np(pos[t] + 1));
                        df_block(qp, op, G, G, kb, vb, pos[t] + 1, scale * ks, vs, sc, wb); /* first == 0 */
                    } else {
                        df_attend_one(qkv + t * QKV + kv * G * D, kb, vb, first, pos[t], windows[l], G, D, scale * ks,
                                      vs, sc, o, NULL, 0);
                    }
                }
            }
            const int back = tid & 1;
            for (int64_t it = last ? -1 : df_claim_item(&claims[l], back), nx; it >= 0; it = nx) {
                nx = df_claim_item(&claims[l], back);
                const char* nk = NULL;
                int64_t nk_lines = 0;
                if (nx >= 0) {
                    const int64_t nt0 = blk_t[nx / NKV], lo = df_first_key(pos[nt0], windows[l]);
                    const int64_t keys = pos[nt0] + 1 - lo;
                    nk = (const char*)kc + (slots[nt0] * c_ss + (nx % NKV) * c_sh + lo * D) * esize;
                    nk_lines = (keys < DF_PREFETCH_KEYS ? keys : DF_PREFETCH_KEYS) * D * esize / 64;
                }
                int64_t b = it / NKV, kv = it % NKV, t0 = blk_t[b], nb = blk_n[b] < 0 ? -blk_n[b] : blk_n[b];
                if (direct && !(blk_n[b] > 1 && blocks)) {
                    const int64_t line = slots[t0] * c_ss + kv * c_sh;
                    for (int64_t t = t0; t < t0 + nb; t++)
                        df_attend_one_fp8(qkv + t * QKV + kv * G * D, (const uint8_t*)kc + line,
                                          (const uint8_t*)vc + line, pos[t], windows[l], G, scale * ks, vs, sc,
                                          attn + t * NH * D + kv * G * D, t + 1 == t0 + nb ? nk : NULL, nk_lines,
                                          &fp8_consts);
                    continue;
                }
                const uint16_t *kb, *vb; /* the run's keys: from its first token's window start to its last token */
                const int64_t first = df_line(kc, vc, slots[t0] * c_ss + kv * c_sh, df_first_key(pos[t0], windows[l]),
                                              pos[t0 + nb - 1] + 1, D, fp8, widened, &kb, &vb);
                if (blk_n[b] > 1 && blocks) {
                    const uint16_t* qp[DF_BLOCK_ROWS];
                    uint16_t* op[DF_BLOCK_ROWS];
                    for (int64_t r = 0; r < nb * G; r++) {
                        qp[r] = qkv + (t0 + r / G) * QKV + (kv * G + r % G) * D;
                        op[r] = attn + (t0 + r / G) * NH * D + (kv * G + r % G) * D;
                    }
                    float* wb = sc + nb * G * df_np(pos[t0 + nb - 1] + 1); /* the bf16 weights after the scores */
                    df_block(qp, op, nb * G, G, kb, vb, pos[t0] + 1, scale * ks, vs, sc, (uint16_t*)wb);
                    continue;
                }
                for (int64_t t = t0; t < t0 + nb; t++) /* a run's tokens share keys: the last one prefetches */
                    df_attend_one(qkv + t * QKV + kv * G * D, kb, vb, first, pos[t], windows[l], G, D, scale * ks, vs,
                                  sc, attn + t * NH * D + kv * G * D, t + 1 == t0 + nb ? nk : NULL, nk_lines);
            }
            df_prefetch_first_panel(o_w, o_c, NH * D, H, tid, nth);
            _Pragma("omp barrier")
            /* 3b. Alternatives, by (group, KV head): borrow the position, attend, put its K/V back. On an fp8
               cache the alternative's K/V go in as codes, as if it were cached (the layer path's
               alternatives_attention does the same), while alt_kv keeps their bf16 values for install. */
            if (ngrp) {
                _Pragma("omp for schedule(static)")
                for (int64_t it = 0; it < ngrp * NKV; it++) {
                    int64_t g = it / NKV, kv = it % NKV, t0 = TM + grp_a[g], ps = pos[t0];
                    const int64_t line = slots[t0] * c_ss + kv * c_sh, at = line + ps * D;
                    const size_t bytes = (size_t)(D * esize);
                    char *kat = (char*)kc + at * esize, *vat = (char*)vc + at * esize;
                    char ksave[512], vsave[512];
                    memcpy(ksave, kat, bytes);
                    memcpy(vsave, vat, bytes);
                    for (int64_t t = t0; t < t0 + grp_n[g]; t++) {
                        const uint16_t* own = alt_kv + (l * A + t - TM) * 2 * NKV * D + kv * D;
                        df_put_row(kc, at, own, D, fp8, ks);
                        df_put_row(vc, at, own + NKV * D, D, fp8, vs);
                        const uint16_t* qr = qkv + t * QKV + kv * G * D;
                        uint16_t* o = attn + t * NH * D + kv * G * D;
                        if (direct) {
                            df_attend_one_fp8(qr, (const uint8_t*)kc + line, (const uint8_t*)vc + line, ps,
                                              windows[l], G, scale * ks, vs, sc, o, NULL, 0, &fp8_consts);
                        } else {
                            const uint16_t *kb, *vb;
                            const int64_t first = df_line(kc, vc, line, df_first_key(ps, windows[l]), ps + 1, D, fp8,
                                                          widened, &kb, &vb);
                            df_attend_one(qr, kb, vb, first, ps, windows[l], G, D, scale * ks, vs, sc, o, NULL, 0);
                        }
                    }
                    memcpy(kat, ksave, bytes);
                    memcpy(vat, vsave, bytes);
                }
            }
            /* From here on the last layer of a pruned forward has the kept tokens' rows only: their residual
               rows move to the front of x (keep is increasing, so no row is overwritten before it is read). */
            const int64_t TL = last ? K : T;
            int64_t llo = tlo, lhi = thi;
            if (last) {
                df_share(TL, tid, nth, &llo, &lhi);
                if (tid == 0)
                    for (int64_t k = 0; k < K; k++)
                        if (keep[k] != k) memcpy(x + k * H, x + keep[k] * H, sizeof(uint16_t) * H);
                _Pragma("omp barrier")
            }
            /* 4. Output projection plus the residual, in place on x (this thread's columns). */
            df_gemm(attn, TL, NH * D, o_w, o_c, o_b, x, H, x, lr[1], nt, tid, nth);
            df_prefetch_first_panel(gu_w, gu_c, H, 2 * I, tid, nth);
            _Pragma("omp barrier")
            /* 5. Post-attention norm; gate and up; silu(gate) * up. */
            df_rmsnorm(x, post_norm, eps, h, llo, lhi, H);
            _Pragma("omp barrier")
            df_gemm(h, TL, H, gu_w, gu_c, gu_b, NULL, 2 * I, gu, lr[2], nt, tid, nth);
            df_prefetch_first_panel(dn_w, dn_c, I, H, tid, nth);
            _Pragma("omp barrier")
            for (int64_t t = llo; t < lhi; t++)
                df_silu_mul(silu_tab, gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
            _Pragma("omp barrier")
            /* 6. Down projection plus the residual, in place on x. */
            df_gemm(act, TL, I, dn_w, dn_c, dn_b, x, H, x, lr[3], nt, tid, nth);
            _Pragma("omp barrier")
        }
        if (prune) df_share(K, tid, nth, &tlo, &thi);
        if (final_norm) { /* NULL: the stack's output is the residual stream itself (an EAGLE head's) */
            df_rmsnorm(x, final_norm, eps, h, tlo, thi, H);
            _Pragma("omp barrier")
            for (int64_t t = tlo; t < thi; t++) memcpy(x + t * H, h + t * H, sizeof(uint16_t) * H);
        }
    }
    free(runs);
}

void decode_forward_bf16(const nxd_decode_args* a) {
    df_forward(a->x, a->T, a->lw, a->windows, a->L, a->final_norm, a->eps, a->cos, a->sin, a->slots, a->pos, a->H,
               a->NH, a->NKV, a->D, a->I, a->c_ss, a->c_sh, a->ws, a->fs, a->A, a->alt_kv, a->nthreads, a->silu_tab,
               a->keep, a->K, a->kv_fp8, a->kv_scales);
}
#else
int decode_forward_available(void) { return 0; }
#endif
