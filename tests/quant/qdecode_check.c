/* qdecode_forward_f32 against the layer path built from the library's own per-op kernels (add_rmsnorm_f32,
   qgemm_f32, rope_f32, slot_attention_f32, silu_mul_f32), as a standalone program: test_qdecode_builds.py compiles
   it with each kernel variant's flags (and with an aarch64 cross compiler, run under qemu-user, for the builds no
   x86 machine can load) and checks that it prints "ok". Exit status 1 and the worst case on a mismatch. */
#include "../../nxdserve/csrc/kernels.c"

#include <stdio.h>

enum { T = 3, H = 64, NH = 4, NKV = 2, D = 16, I = 96, L = 3, S = 3, LEN = 16 };
enum { QS = NH * D, KVS = NKV * D, NQKV = QS + 2 * KVS };

static uint64_t rng_state = 88172645463325252ull;
static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}
static float uniform(void) { return (float)next_u32() / 4294967296.f * 2.f - 1.f; } /* [-1, 1) */
static float* randoms(int64_t n, float lo, float hi) {
    float* p = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) p[i] = lo + (hi - lo) * 0.5f * (uniform() + 1.f);
    return p;
}

typedef struct weight { int fmt; int64_t N, K; uint8_t* w; float* scale; float* offset; } weight;

static weight make_weight(int fmt, int64_t N, int64_t K) {
    weight q = {fmt, N, K, NULL, NULL, NULL};
    const int64_t bytes = N * (fmt == 0 ? K / 2 : K);
    q.w = malloc((size_t)bytes);
    for (int64_t i = 0; i < bytes; i++) {
        uint8_t b = (uint8_t)next_u32();
        if (fmt == 2 && (b & 0x7F) >= 0x70) b &= 0x8F; /* e4m3 codes of moderate size (no NaN, no 448s) */
        q.w[i] = b;
    }
    q.scale = randoms(N * K / 32, fmt == 0 ? 0.01f : 0.0005f, fmt == 0 ? 0.03f : 0.002f);
    q.offset = fmt == 0 ? randoms(N * K / 32, -0.1f, 0.1f) : NULL;
    return q;
}

static void gemm(const weight* q, const float* x, int64_t xs, const float* res, float* out) {
    nxd_qgemm_args a = {0};
    a.x = x; a.M = T; a.K = q->K; a.xs = xs; a.w = q->w; a.scale = q->scale; a.offset = q->offset;
    a.res = res; a.rs = q->N; a.N = q->N; a.out = out; a.os = q->N; a.format = q->fmt; a.nthreads = 1;
    qgemm_f32(&a);
}

int main(void) {
    const int64_t slots[T] = {2, 0, 2}, pos[T] = {5, 3, 6}; /* row 2: slot 2's next token (a verify step) */
    const int64_t windows[L] = {0, 4, 0};
    const float eps = 1e-5f;
    weight wq[L][4];
    float *norm1[L], *norm2[L];
    const size_t cache_floats = (size_t)(S * NKV * LEN * D);
    float *kc[2][L], *vc[2][L];
    const void* lw[L * QDECODE_LAYER_POINTERS];
    int32_t formats[L * 4];
    for (int l = 0; l < L; l++) {
        const int fmt = l % 3; /* q4, q8, fp8 */
        wq[l][0] = make_weight(fmt, NQKV, H);
        wq[l][1] = make_weight(fmt, H, QS);
        wq[l][2] = make_weight(fmt, 2 * I, H);
        wq[l][3] = make_weight(fmt, H, I);
        norm1[l] = randoms(H, 0.8f, 1.2f);
        norm2[l] = randoms(H, 0.8f, 1.2f);
        kc[0][l] = randoms((int64_t)cache_floats, -1.f, 1.f);
        vc[0][l] = randoms((int64_t)cache_floats, -1.f, 1.f);
        for (int c = 0; c < 2; c++) {
            float* src = c ? vc[0][l] : kc[0][l];
            float* copy = malloc(sizeof(float) * cache_floats);
            memcpy(copy, src, sizeof(float) * cache_floats);
            if (c) vc[1][l] = copy; else kc[1][l] = copy;
        }
        const void** p = lw + l * QDECODE_LAYER_POINTERS;
        p[0] = norm1[l];
        for (int j = 0; j < 4; j++) {
            const void** part = p + 1 + 4 * j + (j >= 2); /* the post norm sits between o and gate_up */
            part[0] = wq[l][j].w; part[1] = wq[l][j].scale; part[2] = wq[l][j].offset; part[3] = NULL;
            formats[4 * l + j] = fmt;
        }
        p[9] = norm2[l];
        p[18] = kc[1][l];
        p[19] = vc[1][l];
    }
    float* final_norm = randoms(H, 0.8f, 1.2f);
    float* cos = randoms(T * D, -1.f, 1.f);
    float* sin = randoms(T * D, -1.f, 1.f);
    float* x = randoms(T * H, -1.f, 1.f);
    float* fused = malloc(sizeof(float) * T * H);
    memcpy(fused, x, sizeof(float) * T * H);

    /* the layer path, on cache copy 0 */
    float h[T * H], x2[T * H], qkv[T * NQKV], attn[T * QS], o[T * H], gu[T * 2 * I], act[T * I], ref[T * H];
    for (int l = 0; l < L; l++) {
        add_rmsnorm_f32(x, NULL, norm1[l], eps, NULL, h, T, H, 1);
        gemm(&wq[l][0], h, H, NULL, qkv);
        rope_f32(qkv, NQKV, T, NH + NKV, D, cos, sin, 1);
        nxd_attention_args a = {0};
        a.q = qkv; a.q_st = NQKV; a.q_sh = D; a.k = qkv + QS; a.k_st = NQKV; a.k_sh = D;
        a.v = qkv + QS + KVS; a.v_st = NQKV; a.v_sh = D; a.k_cache = kc[0][l]; a.v_cache = vc[0][l];
        a.c_ss = NKV * LEN * D; a.c_sh = LEN * D; a.slots = slots; a.pos = pos; a.ntok = T; a.sel = NULL;
        a.nsel = T; a.hkv = NKV; a.group = NH / NKV; a.head_dim = D; a.window = windows[l]; a.out = attn;
        a.o_st = QS; a.scale = 1.f / sqrtf((float)D); a.nthreads = 1; a.v_scale = 1.f;
        slot_attention_f32(&a);
        gemm(&wq[l][1], attn, QS, NULL, o);
        add_rmsnorm_f32(x, o, norm2[l], eps, x2, h, T, H, 1);
        gemm(&wq[l][2], h, H, NULL, gu);
        silu_mul_f32(gu, act, T, I, 1);
        gemm(&wq[l][3], act, I, x2, x);
    }
    add_rmsnorm_f32(x, NULL, final_norm, eps, NULL, ref, T, H, 1);

    nxd_qdecode_args q = {0};
    q.x = fused; q.T = T; q.lw = lw; q.formats = formats; q.windows = windows; q.L = L; q.final_norm = final_norm;
    q.cos = cos; q.sin = sin; q.slots = slots; q.pos = pos; q.H = H; q.NH = NH; q.NKV = NKV; q.D = D; q.I = I;
    q.c_ss = NKV * LEN * D; q.c_sh = LEN * D; q.eps = eps; q.nthreads = 2;
    qdecode_forward_f32(&q);

    double worst = 0.0, scale = 1e-6;
    for (int i = 0; i < T * H; i++) scale = fmax(scale, fabs(ref[i]));
    for (int i = 0; i < T * H; i++) worst = fmax(worst, fabs(fused[i] - ref[i]) / scale);
    for (int l = 0; l < L; l++)
        for (size_t i = 0; i < cache_floats; i++) {
            worst = fmax(worst, fabs(kc[0][l][i] - kc[1][l][i]) / (fabs(kc[0][l][i]) + 1.0));
            worst = fmax(worst, fabs(vc[0][l][i] - vc[1][l][i]) / (fabs(vc[0][l][i]) + 1.0));
        }
    if (!(worst < 1e-4)) {
        printf("mismatch: worst relative error %g\n", worst);
        return 1;
    }
    printf("ok worst %g\n", worst);
    return 0;
}
