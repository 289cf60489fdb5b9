/* The fused forward of a quantized decoder stack for a few rows (part of kernels.c; every variant).

   A decode step of a model served from 4/8-bit codes spends most of its time in ~4 quantized GEMVs per layer
   (qgemm.c). Called one by one from Python, each pays a ctypes call and the wake-up of the OpenMP team, and
   between them the other threads sleep while Python runs the norms, RoPE, attention and SiLU. Here all layers
   run in ONE parallel region: every phase is a worksharing loop whose implicit barrier orders it with the next.

   Per layer, for T rows (each its own slot and position; decode rows, several slots, or a verify step's rows of
   one sequence):
     1. RMSNorm of x (each thread its own copy: T x H is tiny, so no barrier), then q/k/v = h @ Wqkv^T;
     2. RoPE on the q and k heads in place; K/V of every row written into its slot's cache line;
     3. attention of each (row, KV head) over its slot's keys lo..pos (attention.c's fp32 item: GQA's query
        heads share each key and value read); then the draft alternatives (EAGLE's tree verification), each
        borrowing its row's draft position for its own K/V;
     4. x += attn @ Wo^T (each output column owned by one thread);
     5. RMSNorm again (per thread), gate and up rows n and I + n by the same thread, act = silu(gate) * up;
     6. x += act @ Wdown^T.
   Then the final RMSNorm in place. Activations and the KV cache are fp32, the weights' codes are widened in
   registers by qgemm.c's row kernels (q_weight_row): the layer path's results to fp32 rounding.

   GEMV rows are shared out in chunks taken as threads free up (q_chunks' shrinking chunks, dynamic schedule), the
   heads one at a time: on a shared machine (other processes, or the server's own event-loop thread) a thread that
   lost its core for a while leaves the later chunks to the others instead of holding every phase's barrier. Each
   row is computed whole by one thread, so the results do not depend on the split. */

enum {
    QD_IN_NORM, QD_QKV, QD_QKV_SCALE, QD_QKV_OFFSET, QD_QKV_BIAS, QD_O, QD_O_SCALE, QD_O_OFFSET, QD_O_BIAS,
    QD_POST_NORM, QD_GU, QD_GU_SCALE, QD_GU_OFFSET, QD_GU_BIAS, QD_DOWN, QD_DOWN_SCALE, QD_DOWN_OFFSET, QD_DOWN_BIAS,
    QD_K_CACHE, QD_V_CACHE, QD_PTRS
};
_Static_assert(QD_PTRS == QDECODE_LAYER_POINTERS, "nxdserve_kernels.h's count of per-layer pointers");

typedef struct qd_linear {
    int fmt;
    const uint8_t* w;
    const float* scale;
    const float* offset;
    const float* bias;
    int64_t nb, row_bytes;
} qd_linear;

static inline qd_linear qd_lin(const void* const* p, int32_t fmt, int64_t K) {
    qd_linear l = {fmt, (const uint8_t*)p[0], (const float*)p[1], (const float*)p[2], (const float*)p[3], K / QB,
                   q_row_bytes(fmt, K)};
    return l;
}

/* One linear's input as the row kernels read it, made by each thread for itself (T rows are tiny: no barrier):
   the rows and, for q4, their block sums; or, with int8 activations (4-bit and int8 codes), the rows rounded to
   int8 per block with their scales and scaled sums (qgemm_i8.c). */
typedef struct qd_input {
    const float* x;
    int64_t xs;
    float* xsum;
    int8_t* xq;
    float* xd;
    float* xds;
    int i8;
} qd_input;

static inline void qd_prepare(qd_input* in, const qd_linear* l, int int8_activations, const float* x, int64_t xs,
                              int64_t T) {
    in->x = x;
    in->xs = xs;
    in->i8 = int8_activations && qi8_serves(l->fmt, T);
    if (in->i8) qi8_quantize_rows(x, T, xs, l->nb * QB, in->xq, in->xd, in->xds);
    else if (l->fmt == 0) q_block_sums(x, T, xs, l->nb, in->xsum);
}

/* dot[t] = weight row n . x[t] (+ bias[n]) for the T rows of the prepared input. */
static inline void qd_row(const qd_linear* l, int64_t n, const qd_input* in, int64_t T, float* dot) {
    if (in->i8) {
        const int64_t K = l->nb * QB;
        for (int64_t t0 = 0; t0 < T; t0 += QI8_T) {
            const int mt = (int)(T - t0 < QI8_T ? T - t0 : QI8_T);
            qi8_rows(l->fmt, l->w + n * l->row_bytes, l->scale + n * l->nb, l->fmt == 0 ? l->offset + n * l->nb : NULL,
                     in->xq + t0 * K, in->xd + t0 * l->nb, in->xds + t0 * l->nb, l->nb, mt, dot + t0);
        }
    } else {
        q_weight_row(l->fmt, l->w, l->scale, l->offset, l->row_bytes, l->nb, n, in->x, in->xs, in->xsum, T, dot);
    }
    if (l->bias)
        for (int64_t t = 0; t < T; t++) dot[t] += l->bias[n];
}

/* dot0[t], dot1[t] = weight rows n0, n1 . x[t] (+ bias): from a few rows (q_pairs_serve) on the paired rows, as
   qgemm_f32 computes them, so the fused and layer paths agree; else two single rows. wide: 2K floats. */
static inline void qd_rows2(const qd_linear* l, int64_t n0, int64_t n1, const qd_input* in, int64_t T, float* dot0,
                            float* dot1, float* wide) {
    if (in->i8 ? qi8_two_rows_serve(l->fmt, T) : q_two_rows_serve(l->fmt, T)) {
        if (in->i8)
            qi8_two_rows(l->w, l->row_bytes, l->scale, l->offset, n0, n1, in->xq, in->xd, in->xds, l->nb, dot0, dot1);
        else
            q_weight_rows2(l->fmt, l->w, l->scale, l->offset, l->row_bytes, l->nb, n0, n1, in->x, in->xsum, dot0,
                           dot1);
        if (l->bias) {
            dot0[0] += l->bias[n0];
            dot1[0] += l->bias[n1];
        }
        return;
    }
#if Q_PAIRS
    if (!in->i8 && q_pairs_serve(l->fmt, T)) {
        q_pair_dots(l->fmt, l->w, l->scale, l->offset, l->row_bytes, l->nb, n0, n1, in->x, in->xs, T, dot0, dot1,
                    wide);
        if (l->bias)
            for (int64_t t = 0; t < T; t++) {
                dot0[t] += l->bias[n0];
                dot1[t] += l->bias[n1];
            }
        return;
    }
#else
    (void)wide;
#endif
    qd_row(l, n0, in, T, dot0);
    qd_row(l, n1, in, T, dot1);
}

/* out[t * os + n] (= or +=, by add) the linear's row n . x[t] for all N rows, two at a time (qd_rows2), shared
   out to the team in the chunks of pairs `bound` cuts (q_chunks): an orphaned worksharing loop, called inside the
   parallel region. */
static inline void qd_linear_out(const qd_linear* l, int64_t N, const qd_input* in, int64_t T, float* dot,
                                 float* wide, float* out, int64_t os, int add, const int64_t* bound, int chunks) {
    _Pragma("omp for schedule(dynamic, 1)")
    for (int c = 0; c < chunks; c++)
    for (int64_t n = 2 * bound[c]; n < 2 * bound[c + 1] && n < N; n += 2) {
        const int64_t rows = n + 1 < N ? 2 : 1;
        if (rows == 2) qd_rows2(l, n, n + 1, in, T, dot, dot + T, wide);
        else qd_row(l, n, in, T, dot);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t t = 0; t < T; t++) {
                float* o = out + t * os + n + r;
                *o = add ? *o + dot[r * T + t] : dot[r * T + t];
            }
    }
}

/* out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), as add_rmsnorm_f32 without the add; out may be x. */
static inline void qd_rmsnorm(const float* x, const float* w, float eps, float* out, int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * H;
        float* o = out + t * H;
        float ss = 0.f;
        for (int64_t c = 0; c < H; c++) ss += xr[c] * xr[c];
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t c = 0; c < H; c++) o[c] = w[c] * (xr[c] * inv);
    }
}

/* In place on one head of D: x = x * cos + rotate_half(x) * sin (rope_f32's arithmetic). */
static inline void qd_rope_head(float* x, const float* cos, const float* sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) {
        float a = x[d], b = x[d + half];
        x[d] = a * cos[d] + -b * sin[d];
        x[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

/* Row r (D values) into a cache at element offset off: fp32, or the codes kv_quant.quantize casts (fp8_code,
   attention.c; an fp8 cache's offsets count bytes). */
static inline void qd_store(float* cache, int64_t off, const float* r, int64_t D, int fp8, float s) {
    if (!fp8) {
        memcpy(cache + off, r, sizeof(float) * (size_t)D);
        return;
    }
    uint8_t* c8 = (uint8_t*)cache + off;
    for (int64_t d = 0; d < D; d++) c8[d] = fp8_code(s == 1.f ? r[d] : fp8_quotient(r[d], s), fp8);
}

/* One (row, KV head) item: q's G heads over the n keys from element offset `line` (key lo's row) into o, with
   attention.c's fp32 items or, on fp8 codes, slot_attention_fp8_f32's (e4m3 rows read as value / 256, the 256
   in the scales). */
static inline void qd_attend(const float* q, const float* kc, const float* vc, int64_t line, int64_t n, int64_t G,
                             int64_t D, float scale, int fp8, float ks, float vs, float* sc, float* o) {
    if (fp8) {
        const uint8_t *kb = (const uint8_t*)kc + line, *vb = (const uint8_t*)vc + line;
        const float u = fp8 == 2 ? 1.f : 256.f, s8 = scale * ks * u, v8 = vs * u;
        if (fp8 == 2) {
            if (D == 64) item_e5m2_f32_64(q, D, kb, vb, n, G, D, s8, sc, o, v8);
            else if (D == 128) item_e5m2_f32_128(q, D, kb, vb, n, G, D, s8, sc, o, v8);
            else item_e5m2_f32_any(q, D, kb, vb, n, G, D, s8, sc, o, v8);
        } else {
            if (D == 64) item_e4m3_f32_64(q, D, kb, vb, n, G, D, s8, sc, o, v8);
            else if (D == 128) item_e4m3_f32_128(q, D, kb, vb, n, G, D, s8, sc, o, v8);
            else item_e4m3_f32_any(q, D, kb, vb, n, G, D, s8, sc, o, v8);
        }
        return;
    }
    const float *kb = kc + line, *vb = vc + line;
    if (D == 64) item_f32_64(q, D, kb, vb, n, G, D, scale, sc, o, 1.f);
    else if (D == 128) item_f32_128(q, D, kb, vb, n, G, D, scale, sc, o, 1.f);
    else item_f32_any(q, D, kb, vb, n, G, D, scale, sc, o, 1.f);
}

void qdecode_forward_f32(const nxd_qdecode_args* a) {
    const int64_t T = a->T, H = a->H, NH = a->NH, NKV = a->NKV, D = a->D, I = a->I;
    const int64_t G = NH / NKV, QS = NH * D, KVS = NKV * D, NQKV = QS + 2 * KVS;
    const int64_t kmax = H > QS ? (H > I ? H : I) : (QS > I ? QS : I);
    const float scale = 1.f / sqrtf((float)D);
    const int64_t A = a->A, TM = T - A; /* the rows' tokens, then the alternatives */
    if (T <= 0 || A < 0 || A > T) return;
    int64_t maxctx = 1;
    for (int64_t t = 0; t < T; t++) maxctx = a->pos[t] + 1 > maxctx ? a->pos[t] + 1 : maxctx;
    /* Alternatives by (slot, position): a row's alternatives share the position they borrow, one after another. */
    int64_t ngrp = 0, *grp_a = (int64_t*)malloc(sizeof(int64_t) * (size_t)(2 * A + 1)), *grp_n = grp_a + A;
    for (int64_t i = 0; i < A;) {
        int64_t e = i + 1;
        while (e < A && a->slots[TM + e] == a->slots[TM + i] && a->pos[TM + e] == a->pos[TM + i]) e++;
        grp_a[ngrp] = i;
        grp_n[ngrp++] = e - i;
        i = e;
    }
    float* x = a->x;
    float* qkv = (float*)malloc(sizeof(float) * (size_t)(T * NQKV));
    float* attn = (float*)malloc(sizeof(float) * (size_t)(T * QS));
    float* act = (float*)malloc(sizeof(float) * (size_t)(T * I));
    const int nt = a->nthreads < 1 ? 1 : a->nthreads;
    int64_t b_qkv[Q_MAX_CHUNKS + 1], b_h[Q_MAX_CHUNKS + 1], b_i[Q_MAX_CHUNKS + 1];
    const int c_qkv = q_chunks((NQKV + 1) / 2, nt, 1, b_qkv), c_h = q_chunks((H + 1) / 2, nt, 1, b_h);
    const int c_i = q_chunks(I, nt, 2, b_i);
    _Pragma("omp parallel num_threads(nt)")
    {
        /* Per thread: its copy of the normed rows, their block sums (q4 offsets), attention scores, dot rows. */
        float* h = (float*)malloc(sizeof(float) * (size_t)(T * H));
        float* xsum = (float*)malloc(sizeof(float) * (size_t)(T * (kmax / QB)));
        int8_t* xq = a->int8_activations ? (int8_t*)malloc((size_t)(T * kmax)) : NULL;
        float* xd = a->int8_activations ? (float*)malloc(sizeof(float) * (size_t)(2 * T * (kmax / QB))) : NULL;
        qd_input in = {NULL, 0, xsum, xq, xd, xd ? xd + T * (kmax / QB) : NULL, 0};
        float* sc = (float*)malloc(sizeof(float) * (size_t)(G * maxctx));
        float* dot = (float*)malloc(sizeof(float) * (size_t)(2 * T));
        float* wide = (float*)malloc(sizeof(float) * (size_t)(2 * kmax)); /* qd_rows2's widened weight rows */
        for (int64_t l = 0; l < a->L; l++) {
            const void* const* p = a->lw + l * QD_PTRS;
            const int32_t* fmt = a->formats + 4 * l;
            const qd_linear wqkv = qd_lin(p + QD_QKV, fmt[0], H), wo = qd_lin(p + QD_O, fmt[1], QS);
            const qd_linear wgu = qd_lin(p + QD_GU, fmt[2], H), wdown = qd_lin(p + QD_DOWN, fmt[3], I);
            float* kc = (float*)p[QD_K_CACHE]; /* fp32, or fp8 codes (kv_fp8: offsets in elements all the same) */
            float* vc = (float*)p[QD_V_CACHE];
            const int64_t window = a->windows ? a->windows[l] : 0;
            const int fp8 = a->kv_fp8;
            const float ks = fp8 ? a->kv_scales[2 * l] : 1.f, vs = fp8 ? a->kv_scales[2 * l + 1] : 1.f;

            /* 1. input norm, q/k/v */
            qd_rmsnorm(x, (const float*)p[QD_IN_NORM], a->eps, h, T, H);
            qd_prepare(&in, &wqkv, a->int8_activations, h, H, T);
            qd_linear_out(&wqkv, NQKV, &in, T, dot, wide, qkv, NQKV, 0, b_qkv, c_qkv);

            /* 2. RoPE on q and k heads; K and V into the cache */
            _Pragma("omp for schedule(dynamic, 1)")
            for (int64_t it = 0; it < T * (NH + NKV); it++) {
                const int64_t t = it / (NH + NKV), head = it % (NH + NKV);
                float* row = qkv + t * NQKV;
                qd_rope_head(row + head * D, a->cos + t * D, a->sin + t * D, D);
                if (head >= NH) {
                    const int64_t j = head - NH, off = a->slots[t] * a->c_ss + j * a->c_sh + a->pos[t] * D;
                    const float *k = row + QS + j * D, *v = row + QS + KVS + j * D;
                    if (t >= TM) { /* an alternative's K/V go to the caller (installed if it is accepted) */
                        float* own = a->alt_kv + ((l * A + t - TM) * 2 * NKV + j) * D;
                        memcpy(own, k, sizeof(float) * (size_t)D);
                        memcpy(own + KVS, v, sizeof(float) * (size_t)D);
                    } else {
                        qd_store(kc, off, k, D, fp8, ks);
                        qd_store(vc, off, v, D, fp8, vs);
                    }
                }
            }

            /* 3. attention of each (row, KV head) over its slot's context */
            _Pragma("omp for schedule(dynamic, 1)")
            for (int64_t it = 0; it < TM * NKV; it++) {
                const int64_t t = it / NKV, j = it % NKV, pos = a->pos[t];
                const int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
                qd_attend(qkv + t * NQKV + j * G * D, kc, vc, a->slots[t] * a->c_ss + j * a->c_sh + lo * D,
                          pos + 1 - lo, G, D, scale, fp8, ks, vs, sc, attn + t * QS + j * G * D);
            }

            /* 3b. Alternatives by (group, KV head), once the rows have attended: each borrows its row's draft
               position for its own K/V (as codes on an fp8 cache, as if cached: the layer path's
               alternatives_attention does the same), attends, and the draft's K/V are put back. */
            if (ngrp) {
                _Pragma("omp for schedule(dynamic, 1)")
                for (int64_t it = 0; it < ngrp * NKV; it++) {
                    const int64_t g = it / NKV, j = it % NKV, t0 = TM + grp_a[g], ps = a->pos[t0];
                    const int64_t lo = (window > 0 && ps - window + 1 > 0) ? ps - window + 1 : 0;
                    const int64_t base = a->slots[t0] * a->c_ss + j * a->c_sh, at = base + ps * D;
                    const size_t bytes = (size_t)D * (fp8 ? 1 : sizeof(float));
                    char* kat = (char*)kc + at * (fp8 ? 1 : (int64_t)sizeof(float));
                    char* vat = (char*)vc + at * (fp8 ? 1 : (int64_t)sizeof(float));
                    char ksave[4 * 256], vsave[4 * 256];
                    memcpy(ksave, kat, bytes);
                    memcpy(vsave, vat, bytes);
                    for (int64_t t = t0; t < t0 + grp_n[g]; t++) {
                        const float* own = a->alt_kv + ((l * A + t - TM) * 2 * NKV + j) * D;
                        qd_store(kc, at, own, D, fp8, ks);
                        qd_store(vc, at, own + KVS, D, fp8, vs);
                        qd_attend(qkv + t * NQKV + j * G * D, kc, vc, base + lo * D, ps + 1 - lo, G, D, scale, fp8, ks,
                                  vs, sc, attn + t * QS + j * G * D);
                    }
                    memcpy(kat, ksave, bytes);
                    memcpy(vat, vsave, bytes);
                }
            }

            /* 4. o-proj and the residual */
            qd_prepare(&in, &wo, a->int8_activations, attn, QS, T);
            qd_linear_out(&wo, H, &in, T, dot, wide, x, H, 1, b_h, c_h);

            /* 5. post-attention norm, gate and up, SiLU(gate) * up */
            qd_rmsnorm(x, (const float*)p[QD_POST_NORM], a->eps, h, T, H);
            qd_prepare(&in, &wgu, a->int8_activations, h, H, T);
            _Pragma("omp for schedule(dynamic, 1)")
            for (int c = 0; c < c_i; c++)
            for (int64_t n = b_i[c]; n < b_i[c + 1]; n++) {
                qd_rows2(&wgu, n, I + n, &in, T, dot, dot + T, wide);
                for (int64_t t = 0; t < T; t++) {
                    const float g = dot[t];
                    act[t * I + n] = g / (1.f + expf(-g)) * dot[T + t];
                }
            }

            /* 6. down-proj and the residual */
            qd_prepare(&in, &wdown, a->int8_activations, act, I, T);
            qd_linear_out(&wdown, H, &in, T, dot, wide, x, H, 1, b_h, c_h);
        }
        if (a->final_norm) {
            _Pragma("omp for schedule(static)")
            for (int64_t t = 0; t < T; t++) qd_rmsnorm(x + t * H, a->final_norm, a->eps, x + t * H, 1, H);
        }
        free(h);
        free(xsum);
        free(xq);
        free(xd);
        free(sc);
        free(dot);
        free(wide);
    }
    free(qkv);
    free(attn);
    free(act);
    free(grp_a);
}
