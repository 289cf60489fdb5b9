/* Slot attention over the KV cache (part of kernels.c); see cpu_kernels.py for what it replaces and
   why. */

#define MAXG 16
#define MAXD 256
#define PF 16 /* software prefetch distance, in rows (measured: -20% time at 100 keys, cold cache) */


/* One (token, KV head) item: G queries (rows q + g*q_sh) against n keys and values (rows of D at kb,
   vb), softmax in fp32, output rows o + g*D. DD is a constant for the common head sizes, so the row
   loops unroll into registers. sc: scratch of G*n floats. */
#define DEFINE_ITEM(NAME, T, LOAD, STORE, DD, DMAX) \
    DEFINE_ITEM_KV(NAME, T, LOAD, STORE, T, LOAD, ROWS_EACH, VS_NONE, DD, DMAX)
#define VS_NONE(x) (x)
#define VS_FP8(x) ((x) * vs)
/* fp8 codes widened by bit arithmetic (exact; branch-free, so the row loops vectorize, unlike a table
   gather). e4m3fn: bias 7, subnormals mant * 2^-9; e5m2: bias 15, subnormals mant * 2^-16. The NaN/inf codes
   never occur: writes saturate (kv_quant.quantize). */
static inline float fp8_bits_to_f32(uint8_t b, int mbits, uint32_t bias_shift, float sub_unit) {
    uint32_t sign = (uint32_t)(b & 0x80) << 24;
    uint32_t em = b & 0x7F;
    union { uint32_t u; float f; } normal = {sign | ((em << (23 - mbits)) + bias_shift)};
    float sub = (float)(b & ((1 << mbits) - 1)) * sub_unit;
    return (em >> mbits) ? normal.f : (sign ? -sub : sub);
}
#define E4M3(x) fp8_bits_to_f32((x), 3, 120u << 23, 1.f / 512.f)
#define E5M2(x) fp8_bits_to_f32((x), 2, 112u << 23, 1.f / 65536.f)

/* A row of n codes to fp32. e5m2 is the top byte of an fp16, and e4m3fn's bits placed in an fp16's (sign at 15,
   exponent and mantissa from bit 7) read as its value / 256 (fp16's bias is 8 more), subnormals included: so
   with F16C both are one shift and one vcvtph2ps per 8 codes. The e4m3 rows hold value / 256 on every path; the
   kernels fold the 256 into their K and V scales. */
#if defined(__F16C__)
#include <immintrin.h>
static inline void fp8_row(const uint8_t* src, float* dst, int64_t n, int e4m3) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(src + d)));
        h = e4m3 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                                _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7))
                 : _mm_slli_epi16(h, 8);
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(h));
    }
    for (; d < n; d++) dst[d] = e4m3 ? E4M3(src[d]) * (1.f / 256.f) : E5M2(src[d]);
}
#else
static inline void fp8_row(const uint8_t* src, float* dst, int64_t n, int e4m3) {
    for (int64_t d = 0; d < n; d++) dst[d] = e4m3 ? E4M3(src[d]) * (1.f / 256.f) : E5M2(src[d]);
}
#endif
/* The code of y (fmt 1 e4m3fn, 2 e5m2) as torch casts an fp32 (``kv_quant.quantize``, after its clamp): saturated
   at the format's largest value, rounded to nearest even, NaN kept. Integer arithmetic throughout (the kernels
   build with -ffast-math, under which the compiler may fold NaN tests away): e4m3fn has 3 mantissa bits and bias 7
   (largest 448, subnormal steps of 2^-9), e5m2 2 bits and bias 15 (57344, 2^-16). */
static inline uint8_t fp8_code(float y, int fmt) {
    union { float f; uint32_t u; } v = {y};
    const uint8_t sign = (uint8_t)((v.u >> 24) & 0x80);
    const uint32_t a = v.u & 0x7FFFFFFFu;
    const int mbits = fmt == 2 ? 2 : 3;
    const uint32_t bias = fmt == 2 ? 15u : 7u;
    const uint32_t largest = fmt == 2 ? 0x47600000u : 0x43E00000u; /* 57344.f, 448.f */
    if (a > 0x7F800000u) return sign | 0x7F;                         /* NaN stays NaN (torch's clamp keeps it) */
    const uint32_t m = a < largest ? a : largest;                    /* saturate, infinities included */
    const uint32_t e = m >> 23;
    if (e + bias > 127u) { /* normal in fp8: round the mantissa to mbits bits, nearest even; a carry moves e */
        const uint32_t drop = 23u - (uint32_t)mbits;
        const uint32_t r = m + ((1u << (drop - 1)) - 1u) + ((m >> drop) & 1u);
        return sign | (uint8_t)((r >> drop) - ((127u - bias) << mbits));
    }
    /* subnormal in fp8 (or zero): (1.mant * 2^(e-127)) / 2^(1 - bias - mbits), rounded to nearest even; a
       result of 1 << mbits is the first normal code, as it should be */
    if (e == 0) return sign; /* fp32 zeros and subnormals are far below half a step */
    const uint32_t full = (m & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 23u + (127u - bias - (uint32_t)mbits + 1u) - e;
    if (shift >= 32u) return sign;
    uint32_t q = full >> shift;
    const uint32_t rest = full & ((1u << shift) - 1u), half = 1u << (shift - 1);
    q += rest > half || (rest == half && (q & 1u));
    return sign | (uint8_t)q;
}

/* x / s correctly rounded, as torch divides before its cast: under -ffast-math a plain division may become a
   product with the reciprocal (seen: other codes for 32 of 65536 bf16 values at scale 3.1). Only calculated
   scales (--calculate-kv-scales) divide; 1.0 does not call this. */
#if defined(__clang__)
static float fp8_quotient(float x, float s) {
#pragma float_control(precise, on)
    return x / s;
}
#else
__attribute__((noinline, optimize("no-fast-math"))) static float fp8_quotient(float x, float s) { return x / s; }
#endif

/* n fp32 values to codes as the fused forwards write them (tests compare it with torch's cast on every build). */
void kv_fp8_store_f32(uint8_t* dst, const float* src, int64_t n, int32_t kv_fp8, float scale) {
    for (int64_t i = 0; i < n; i++) dst[i] = fp8_code(scale == 1.f ? src[i] : fp8_quotient(src[i], scale), kv_fp8);
}

#define ROWS_EACH(dst, src, n, KLOAD) for (int64_t d = 0; d < n; d++) dst[d] = KLOAD(src[d])
#define ROWS_E4M3(dst, src, n, KLOAD) fp8_row(src, dst, n, 1)
#define ROWS_E5M2(dst, src, n, KLOAD) fp8_row(src, dst, n, 0)
/* KT/KLOAD: the cache's element type and its widening (E4M3/E5M2 for fp8 codes); VS: what each output value gets
   before its store (the fp8 V scale ``vs``; the model-dtype kernels get nothing). */
#define DEFINE_ITEM_KV(NAME, T, LOAD, STORE, KT, KLOAD, ROWS, VS, DD, DMAX)                              \
static void NAME(const T* q, int64_t q_sh, const KT* kb, const KT* vb, int64_t n, int64_t G, int64_t D, \
                 float scale, float* sc, T* o, float vs) {                                              \
    (void)D; (void)vs;                                                                                  \
    float qf[MAXG][DMAX] __attribute__((aligned(64)));                                                  \
    float acc[MAXG][DMAX] __attribute__((aligned(64)));                                                 \
    float row[DMAX] __attribute__((aligned(64)));                                                       \
    float inv[MAXG];                                                                                    \
    for (int64_t g = 0; g < G; g++)                                                                     \
        for (int64_t d = 0; d < DD; d++) qf[g][d] = LOAD(q[g * q_sh + d]) * scale;                      \
    for (int64_t j = 0; j < n; j++) {                                                                   \
        const KT* kr = kb + j * DD;                                                                     \
        __builtin_prefetch(kr + PF * DD);                                                               \
        __builtin_prefetch((const char*)(kr + PF * DD) + 64);                                           \
        ROWS(row, kr, DD, KLOAD);                                                                       \
        for (int64_t g = 0; g < G; g++) {                                                               \
            float s = 0.f;                                                                              \
            for (int64_t d = 0; d < DD; d++) s += qf[g][d] * row[d];                                    \
            sc[g * n + j] = s;                                                                          \
        }                                                                                               \
    }                                                                                                   \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        float* sg = sc + g * n;                                                                         \
        float m = sg[0];                                                                                \
        for (int64_t j = 1; j < n; j++) m = fmaxf(m, sg[j]);                                            \
        float sum = 0.f;                                                                                \
        for (int64_t j = 0; j < n; j++) { float e = expf(sg[j] - m); sg[j] = e; sum += e; }             \
        inv[g] = 1.f / sum;                                                                             \
        for (int64_t d = 0; d < DD; d++) acc[g][d] = 0.f;                                               \
    }                                                                                                   \
    for (int64_t j = 0; j < n; j++) {                                                                   \
        const KT* vr = vb + j * DD;                                                                     \
        __builtin_prefetch(vr + PF * DD);                                                               \
        __builtin_prefetch((const char*)(vr + PF * DD) + 64);                                           \
        ROWS(row, vr, DD, KLOAD);                                                                       \
        for (int64_t g = 0; g < G; g++) {                                                               \
            float w = sc[g * n + j];                                                                    \
            for (int64_t d = 0; d < DD; d++) acc[g][d] += w * row[d];                                   \
        }                                                                                               \
    }                                                                                                   \
    for (int64_t g = 0; g < G; g++)                                                                     \
        for (int64_t d = 0; d < DD; d++) o[g * DD + d] = STORE(VS(acc[g][d] * inv[g]));                 \
}

/* q[t, hq, :] at q + t*q_st + hq*q_sh (hq = h*G + g); k/v likewise with k_st, k_sh / v_st, v_sh.
   Cache line of slot s, KV head h, position p at c + s*c_ss + h*c_sh + p*D.
   Token t (all ntok) writes its K/V at (slots[t], pos[t]); token sel[i] (or i when sel is NULL,
   i < nsel) attends to keys lo..pos[t] of its slot, lo = pos - window + 1 when window > 0.
   out[t, hq*D + d] at out + t*o_st + hq*D + d. */
/* KT: the cache's element type; k and v point at KT rows too (an fp8 cache gets codes torch has already cast, so
   every path stores the same ones). k == NULL: nothing to write, attend only. */
#define DEFINE_KERNEL(NAME, T, I64, I128, IANY) DEFINE_KERNEL_KV(NAME, T, T, I64, I128, IANY)
#define DEFINE_KERNEL_KV(NAME, T, KT, I64, I128, IANY)                                                  \
static void NAME(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_st, int64_t k_sh,              \
          const T* v, int64_t v_st, int64_t v_sh, KT* kc, KT* vc, int64_t c_ss, int64_t c_sh,           \
          const int64_t* slots, const int64_t* pos, int64_t ntok, const int64_t* sel, int64_t nsel,    \
          int64_t hkv, int64_t G, int64_t D, int64_t window, float scale, T* out, int64_t o_st,        \
          int nthreads, float vs) {                                                                     \
    int64_t maxctx = 1, work = 0;                                                                       \
    for (int64_t i = 0; i < nsel; i++) {                                                                \
        int64_t t = sel ? sel[i] : i;                                                                   \
        if (pos[t] + 1 > maxctx) maxctx = pos[t] + 1;                                                   \
        work += pos[t] + 1;                                                                             \
    }                                                                                                   \
    int nt = nthreads < 1 ? 1 : nthreads;                                                               \
    if (work * hkv < 2048) nt = 1; /* waking the other threads would cost more than it saves */         \
    _Pragma("omp parallel num_threads(nt)")                                                             \
    {                                                                                                   \
        _Pragma("omp for schedule(static)")                                                             \
        for (int64_t it = 0; it < (k ? ntok * hkv : 0); it++) {                                         \
            int64_t t = it / hkv, h = it % hkv;                                                         \
            int64_t off = slots[t] * c_ss + h * c_sh + pos[t] * D;                                      \
            memcpy(kc + off, (const KT*)k + t * k_st + h * k_sh, sizeof(KT) * D);                       \
            memcpy(vc + off, (const KT*)v + t * v_st + h * v_sh, sizeof(KT) * D);                       \
        }                                                                                               \
        float* sc = (float*)malloc(sizeof(float) * G * maxctx);                                         \
        _Pragma("omp for schedule(static)")                                                             \
        for (int64_t it = 0; it < nsel * hkv; it++) {                                                   \
            int64_t t = sel ? sel[it / hkv] : it / hkv, h = it % hkv;                                   \
            int64_t p = pos[t], lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;          \
            const T* qr = q + t * q_st + h * G * q_sh;                                                  \
            const KT* kb = kc + slots[t] * c_ss + h * c_sh + lo * D;                                    \
            const KT* vb = vc + slots[t] * c_ss + h * c_sh + lo * D;                                    \
            T* o = out + t * o_st + h * G * D;                                                          \
            if (D == 64) I64(qr, q_sh, kb, vb, p + 1 - lo, G, D, scale, sc, o, vs);                \
            else if (D == 128) I128(qr, q_sh, kb, vb, p + 1 - lo, G, D, scale, sc, o, vs);         \
            else IANY(qr, q_sh, kb, vb, p + 1 - lo, G, D, scale, sc, o, vs);                       \
        }                                                                                               \
        free(sc);                                                                                       \
    }                                                                                                   \
}

DEFINE_ITEM(item_bf16_64, uint16_t, bf2f, f2bf, 64, 64)
DEFINE_ITEM(item_bf16_128, uint16_t, bf2f, f2bf, 128, 128)
DEFINE_ITEM(item_bf16_any, uint16_t, bf2f, f2bf, D, MAXD)
DEFINE_ITEM(item_f32_64, float, F32, F32, 64, 64)
DEFINE_ITEM(item_f32_128, float, F32, F32, 128, 128)
DEFINE_ITEM(item_f32_any, float, F32, F32, D, MAXD)
DEFINE_KERNEL(slot_attention_bf16_impl, uint16_t, item_bf16_64, item_bf16_128, item_bf16_any)
DEFINE_KERNEL(slot_attention_f32_impl, float, item_f32_64, item_f32_128, item_f32_any)
/* fp8 KV: a decode reads a quarter of fp32's bytes, half of bf16's. One kernel per (activation, fp8 format). */
#define DEFINE_FP8(SUFFIX, T, LOAD, STORE, KLOAD)                                                         \
DEFINE_ITEM_KV(item_##SUFFIX##_64, T, LOAD, STORE, uint8_t, KLOAD, ROWS_##KLOAD, VS_FP8, 64, 64)          \
DEFINE_ITEM_KV(item_##SUFFIX##_128, T, LOAD, STORE, uint8_t, KLOAD, ROWS_##KLOAD, VS_FP8, 128, 128)       \
DEFINE_ITEM_KV(item_##SUFFIX##_any, T, LOAD, STORE, uint8_t, KLOAD, ROWS_##KLOAD, VS_FP8, D, MAXD)        \
DEFINE_KERNEL_KV(slot_attention_##SUFFIX##_impl, T, uint8_t, item_##SUFFIX##_64, item_##SUFFIX##_128,     \
                 item_##SUFFIX##_any)
DEFINE_FP8(e4m3_bf16, uint16_t, bf2f, f2bf, E4M3)
DEFINE_FP8(e5m2_bf16, uint16_t, bf2f, f2bf, E5M2)
DEFINE_FP8(e4m3_f32, float, F32, F32, E4M3)
DEFINE_FP8(e5m2_f32, float, F32, F32, E5M2)


#define CALL_IMPL(IMPL, T, KT, a)                                                                       \
    IMPL((const T*)a->q, a->q_st, a->q_sh, (const T*)a->k, a->k_st, a->k_sh, (const T*)a->v,            \
         a->v_st, a->v_sh, (KT*)a->k_cache, (KT*)a->v_cache, a->c_ss, a->c_sh, a->slots, a->pos,        \
         a->ntok, a->sel, a->nsel, a->hkv, a->group, a->head_dim, a->window, a->scale, (T*)a->out,       \
         a->o_st, a->nthreads, a->v_scale)
#define DEFINE_ENTRY(NAME, T)                                                                           \
void NAME(const nxd_attention_args* a) { CALL_IMPL(NAME##_impl, T, T, a); }
DEFINE_ENTRY(slot_attention_bf16, uint16_t)
DEFINE_ENTRY(slot_attention_f32, float)
void slot_attention_fp8_bf16(const nxd_attention_args* a) {
    if (a->kv_fp8 == 2) { CALL_IMPL(slot_attention_e5m2_bf16_impl, uint16_t, uint8_t, a); return; }
    nxd_attention_args b = *a; /* e4m3 rows hold value / 256 (fp8_row) */
    b.scale *= 256.f; b.v_scale *= 256.f;
    CALL_IMPL(slot_attention_e4m3_bf16_impl, uint16_t, uint8_t, (&b));
}
void slot_attention_fp8_f32(const nxd_attention_args* a) {
    if (a->kv_fp8 == 2) { CALL_IMPL(slot_attention_e5m2_f32_impl, float, uint8_t, a); return; }
    nxd_attention_args b = *a;
    b.scale *= 256.f; b.v_scale *= 256.f;
    CALL_IMPL(slot_attention_e4m3_f32_impl, float, uint8_t, (&b));
}
