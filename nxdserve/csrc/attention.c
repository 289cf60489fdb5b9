/* Slot attention over the KV cache (part of kernels.c); see cpu_kernels.py for what it replaces and
   why. */

#define MAXG 16
#define MAXD 256
#define PF 16 /* software prefetch distance, in rows (measured: -20% time at 100 keys, cold cache) */


/* One (token, KV head) item: G queries (rows q + g*q_sh) against n keys and values (rows of D at kb,
   vb), softmax in fp32, output rows o + g*D. DD is a constant for the common head sizes, so the row
   loops unroll into registers. sc: scratch of G*n floats. */
#define DEFINE_ITEM(NAME, T, LOAD, STORE, DD, DMAX) DEFINE_ITEM_KV(NAME, T, LOAD, STORE, T, LOAD, VS_NONE, DD, DMAX)
#define VS_NONE(x) (x)
#define VS_FP8(x) ((x) * vs)
#define LUT(x) lut[x]
/* KT/KLOAD: the cache's element type and its widening (an fp8 code through the 256-entry table ``lut``); VS: what
   each output value gets before its store (the fp8 V scale ``vs``; the model-dtype kernels get nothing). */
#define DEFINE_ITEM_KV(NAME, T, LOAD, STORE, KT, KLOAD, VS, DD, DMAX)                                    \
static void NAME(const T* q, int64_t q_sh, const KT* kb, const KT* vb, int64_t n, int64_t G, int64_t D, \
                 float scale, float* sc, T* o, const float* lut, float vs) {                            \
    (void)D; (void)lut; (void)vs;                                                                       \
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
        for (int64_t d = 0; d < DD; d++) row[d] = KLOAD(kr[d]);                                         \
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
        for (int64_t d = 0; d < DD; d++) row[d] = KLOAD(vr[d]);                                         \
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
/* KT: the cache's element type. An fp8 cache (KT uint8_t) is written by the caller (torch's fp8 cast, so every
   path stores the same codes): its kernels only attend, with k == NULL. */
#define DEFINE_KERNEL(NAME, T, I64, I128, IANY) DEFINE_KERNEL_KV(NAME, T, T, I64, I128, IANY)
#define DEFINE_KERNEL_KV(NAME, T, KT, I64, I128, IANY)                                                  \
static void NAME(const T* q, int64_t q_st, int64_t q_sh, const T* k, int64_t k_st, int64_t k_sh,              \
          const T* v, int64_t v_st, int64_t v_sh, KT* kc, KT* vc, int64_t c_ss, int64_t c_sh,           \
          const int64_t* slots, const int64_t* pos, int64_t ntok, const int64_t* sel, int64_t nsel,    \
          int64_t hkv, int64_t G, int64_t D, int64_t window, float scale, T* out, int64_t o_st,        \
          int nthreads, const float* lut, float vs) {                                                   \
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
            memcpy(kc + off, k + t * k_st + h * k_sh, sizeof(T) * D);                                   \
            memcpy(vc + off, v + t * v_st + h * v_sh, sizeof(T) * D);                                   \
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
            if (D == 64) I64(qr, q_sh, kb, vb, p + 1 - lo, G, D, scale, sc, o, lut, vs);                \
            else if (D == 128) I128(qr, q_sh, kb, vb, p + 1 - lo, G, D, scale, sc, o, lut, vs);         \
            else IANY(qr, q_sh, kb, vb, p + 1 - lo, G, D, scale, sc, o, lut, vs);                       \
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
/* fp8 KV (either format: the table says which): a decode reads a quarter of fp32's bytes, half of bf16's. */
DEFINE_ITEM_KV(item_bf16_fp8_64, uint16_t, bf2f, f2bf, uint8_t, LUT, VS_FP8, 64, 64)
DEFINE_ITEM_KV(item_bf16_fp8_128, uint16_t, bf2f, f2bf, uint8_t, LUT, VS_FP8, 128, 128)
DEFINE_ITEM_KV(item_bf16_fp8_any, uint16_t, bf2f, f2bf, uint8_t, LUT, VS_FP8, D, MAXD)
DEFINE_ITEM_KV(item_f32_fp8_64, float, F32, F32, uint8_t, LUT, VS_FP8, 64, 64)
DEFINE_ITEM_KV(item_f32_fp8_128, float, F32, F32, uint8_t, LUT, VS_FP8, 128, 128)
DEFINE_ITEM_KV(item_f32_fp8_any, float, F32, F32, uint8_t, LUT, VS_FP8, D, MAXD)
DEFINE_KERNEL_KV(slot_attention_fp8_bf16_impl, uint16_t, uint8_t, item_bf16_fp8_64, item_bf16_fp8_128,
                 item_bf16_fp8_any)
DEFINE_KERNEL_KV(slot_attention_fp8_f32_impl, float, uint8_t, item_f32_fp8_64, item_f32_fp8_128, item_f32_fp8_any)


#define DEFINE_ENTRY(NAME, T, KT)                                                                       \
void NAME(const nxd_attention_args* a) {                                                                \
    NAME##_impl((const T*)a->q, a->q_st, a->q_sh, (const T*)a->k, a->k_st, a->k_sh, (const T*)a->v,     \
                a->v_st, a->v_sh, (KT*)a->k_cache, (KT*)a->v_cache, a->c_ss, a->c_sh, a->slots, a->pos, \
                a->ntok, a->sel, a->nsel, a->hkv, a->group, a->head_dim, a->window, a->scale, (T*)a->out, \
                a->o_st, a->nthreads, a->kv_lut, a->v_scale);                                           \
}
DEFINE_ENTRY(slot_attention_bf16, uint16_t, uint16_t)
DEFINE_ENTRY(slot_attention_f32, float, float)
DEFINE_ENTRY(slot_attention_fp8_bf16, uint16_t, uint8_t)
DEFINE_ENTRY(slot_attention_fp8_f32, float, uint8_t)
