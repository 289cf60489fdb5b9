/* qgemm_f32 against a double-precision reference, as a standalone program: test_qgemm_builds.py compiles it with
   each kernel variant's flags (and with an aarch64 cross compiler, run under qemu-user, for the NEON path that no
   x86 machine can load) and checks that it prints "ok". Exit status 1 and the worst case on a mismatch. */
#include "../../nxdserve/csrc/kernels.c"

#include <stdio.h>

#include "greedy_check.h"

static uint64_t rng_state = 88172645463325252ull;
static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}
static float uniform(void) { return (float)next_u32() / 4294967296.f * 2.f - 1.f; } /* [-1, 1) */

static double e4m3_value(uint8_t b) {
    const int sign = b >> 7, exponent = (b >> 3) & 0xF, mantissa = b & 7;
    double v = exponent == 0 ? ldexp(mantissa / 8.0, -6) : ldexp(1.0 + mantissa / 8.0, exponent - 7);
    return sign ? -v : v;
}

/* Weight n's element k as the float64 reference reads it. */
static double ref_weight(int fmt, const uint8_t* w, const float* scale, const float* offset, int64_t row_bytes,
                         int64_t nb, int64_t n, int64_t k) {
    const uint8_t* row = w + n * row_bytes;
    const int64_t b = k / QB, i = k % QB;
    if (fmt == 0) {
        const uint8_t byte = row[b * 16 + (i % 16)];
        return (i < 16 ? byte & 0x0F : byte >> 4) * (double)scale[n * nb + b] + offset[n * nb + b];
    }
    if (fmt == 1) return (int8_t)row[k] * (double)scale[n * nb + b];
    if (fmt == 3) {
        uint16_t h;
        memcpy(&h, row + 2 * k, 2);
        return bf2f(h);
    }
    return e4m3_value(row[k]) * scale[n * nb + b];
}

/* One case: returns the worst |out - ref| / (sum |w x| + 1e-6) over the outputs, and over q_widen_f32's
   widened weight its worst |wide - ref| over the size of its terms (fp32 rounding). */
static double run_case(int fmt, int64_t M, int64_t N, int64_t K, int with_residual) {
    const int64_t nb = K / QB, row_bytes = q_row_bytes(fmt, K);
    uint8_t* w = malloc((size_t)(N * row_bytes));
    float* scale = malloc(sizeof(float) * (size_t)(N * nb));
    float* offset = malloc(sizeof(float) * (size_t)(N * nb));
    float* x = malloc(sizeof(float) * (size_t)(M * K));
    float* res = malloc(sizeof(float) * (size_t)(M * N));
    float* out = malloc(sizeof(float) * (size_t)(M * N));
    for (int64_t i = 0; i < N * row_bytes; i++) {
        uint8_t b = (uint8_t)next_u32();
        if (fmt == 2 && (b & 0x7F) == 0x7F) b ^= 1; /* e4m3fn's NaN codes never come out of a quantizer */
        w[i] = b;
    }
    if (fmt == 3) /* bf16: the top halves of finite floats in [-2, 2) (random bits could be NaN or overflow) */
        for (int64_t i = 0; i < N * K; i++) {
            const float v = 2.f * uniform();
            uint32_t bits;
            memcpy(&bits, &v, 4);
            const uint16_t h = (uint16_t)(bits >> 16);
            memcpy(w + 2 * i, &h, 2);
        }
    for (int64_t i = 0; i < N * nb; i++) { scale[i] = 0.01f + 0.05f * (uniform() + 1.f); offset[i] = 0.1f * uniform(); }
    for (int64_t i = 0; i < M * K; i++) x[i] = uniform();
    for (int64_t i = 0; i < M * N; i++) res[i] = uniform();
    nxd_qgemm_args a = {0};
    a.x = x; a.M = M; a.K = K; a.xs = K; a.w = w; a.scale = fmt == 3 ? NULL : scale; a.offset = fmt == 0 ? offset : NULL;
    a.format = fmt; a.N = N; a.res = with_residual ? res : NULL; a.rs = N; a.out = out; a.os = N; a.nthreads = 2;
    qgemm_f32(&a);
    double worst = 0.0;
    if (!greedy_tokens_match(qgemm_f32, &a, out)) worst = 1.0; /* reported as a mismatch */
    float* wide = malloc(sizeof(float) * (size_t)(N * K));
    q_widen_f32(&a, wide);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            const double ref = ref_weight(fmt, w, scale, offset, row_bytes, nb, n, k);
            /* q4's code * scale + offset may round twice (no FMA in portable C): bound by the terms' size */
            const double size = fabs(ref) + (fmt == 0 ? fabs(offset[n * nb + k / QB]) : 0.0) + 1e-6;
            const double err = fabs(wide[n * K + k] - ref) / size;
            if (err > worst) worst = err;
        }
    free(wide);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double ref = with_residual ? res[m * N + n] : 0.0, mag = 1e-6;
            for (int64_t k = 0; k < K; k++) {
                const double wv = ref_weight(fmt, w, scale, offset, row_bytes, nb, n, k);
                ref += wv * x[m * K + k];
                mag += fabs(wv * x[m * K + k]);
            }
            const double err = fabs(out[m * N + n] - ref) / mag;
            if (err > worst) worst = err;
        }
    free(w); free(scale); free(offset); free(x); free(res); free(out);
    return worst;
}

/* One row of x gives the same outputs bit for bit alone (M = 1: the two-rows kernel where the build has it) as in
   a call of two rows (M = 2: q_weight_row's tiles), on nt threads; an odd N leaves a last row alone. Returns 0 on
   a difference (and prints it). */
static int rows_alone_ok(int fmt, int64_t N, int64_t K, int nt) {
    const int64_t nb = K / QB, row_bytes = q_row_bytes(fmt, K);
    uint8_t* w = malloc((size_t)(N * row_bytes));
    float* scale = malloc(sizeof(float) * (size_t)(N * nb));
    float* offset = malloc(sizeof(float) * (size_t)(N * nb));
    float* x = malloc(sizeof(float) * (size_t)(2 * K));
    float* one = malloc(sizeof(float) * (size_t)N);
    float* two = malloc(sizeof(float) * (size_t)(2 * N));
    for (int64_t i = 0; i < N * row_bytes; i++) w[i] = (uint8_t)(next_u32() & (fmt == 2 ? 0x7E : 0xFF));
    if (fmt == 3)
        for (int64_t i = 0; i < N * K; i++) ((uint16_t*)w)[i] = (uint16_t)(0x3F00 + (next_u32() & 0xFF));
    for (int64_t i = 0; i < N * nb; i++) { scale[i] = 0.01f + 0.05f * (uniform() + 1.f); offset[i] = 0.1f * uniform(); }
    for (int64_t k = 0; k < K; k++) { x[k] = uniform(); x[K + k] = uniform(); }
    nxd_qgemm_args a = {0};
    a.x = x; a.K = K; a.xs = K; a.w = w; a.scale = fmt == 3 ? NULL : scale; a.offset = fmt == 0 ? offset : NULL;
    a.format = fmt; a.N = N; a.os = N; a.nthreads = nt;
    a.M = 1; a.out = one;
    qgemm_f32(&a);
    a.M = 2; a.out = two;
    qgemm_f32(&a);
    int good = memcmp(one, two, sizeof(float) * (size_t)N) == 0;
    if (!good) printf("rows differ alone and in two: format %d N %ld K %ld threads %d\n", fmt, (long)N, (long)K, nt);
    free(w); free(scale); free(offset); free(x); free(one); free(two);
    return good;
}

/* q_chunks' cuts: contiguous from 0 to n, each a multiple of unit but the last, at least Q_MIN_ITEMS but the
   last, no longer than the one before, at most Q_MAX_CHUNKS of them. Returns 0 on a bad cut (and prints it). */
static int chunks_ok(int64_t n, int nt, int64_t unit) {
    int64_t bound[Q_MAX_CHUNKS + 1];
    const int c = q_chunks(n, nt, unit, bound);
    int good = c >= (n > 0) && c <= Q_MAX_CHUNKS && bound[0] == 0 && bound[c] == n;
    for (int i = 0; good && i < c; i++) {
        const int64_t size = bound[i + 1] - bound[i];
        const int last = i == c - 1;
        good = size > 0 && (last || (size % unit == 0 && size >= Q_MIN_ITEMS)) &&
               (i == 0 || size <= bound[i] - bound[i - 1]);
    }
    if (!good) printf("bad chunks: n %ld threads %d unit %ld: %d chunks\n", (long)n, nt, (long)unit, c);
    return good;
}

/* fp8_code (the fused quantized forward's KV cast, attention.c) at scale 1 against the nearest code found by
   search, ties to the even code; every bf16 value, both formats. Differences to the two codes around a value are
   exact (Sterbenz), so the search is exact under -ffast-math too. */
static int fp8_codes_ok(void) {
    for (int fmt = 1; fmt <= 2; fmt++) {
        const int top = fmt == 2 ? 0x7B : 0x7E; /* the largest finite code */
        for (uint32_t b = 0; b < 65536; b++) {
            union { uint32_t u; float f; } v = {b << 16};
            if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) continue; /* NaN */
            float a = fabsf(v.f), best_diff = 0.f;
            int best = -1;
            for (int c = 0; c <= top; c++) {
                const float d = fmt == 2 ? E5M2((uint8_t)c) : E4M3((uint8_t)c);
                const float diff = d > a ? d - a : a - d;
                if (best < 0 || diff < best_diff || (diff == best_diff && !(c & 1))) { best = c; best_diff = diff; }
            }
            if (a >= (fmt == 2 ? E5M2((uint8_t)top) : E4M3((uint8_t)top))) best = top; /* saturation */
            const uint8_t want = (uint8_t)(((v.u >> 24) & 0x80) | (uint32_t)best);
            uint8_t got;
            kv_fp8_store_f32(&got, &v.f, 1, fmt, 1.f);
            if (got != want) {
                printf("fp8 %d: %g coded %d, the nearest code is %d\n", fmt, (double)v.f, got, want);
                return 0;
            }
        }
    }
    return 1;
}

int main(void) {
    if (!fp8_codes_ok()) return 1;
    static const int64_t chunk_ns[] = {0, 1, 7, 8, 9, 100, 480, 1536, 49152, 1000003, 100000000};
    for (size_t i = 0; i < sizeof chunk_ns / sizeof *chunk_ns; i++)
        for (int nt = 1; nt <= 256; nt *= 4)
            for (int64_t unit = 1; unit <= 16; unit *= 2)
                if (!chunks_ok(chunk_ns[i], nt, unit)) return 1;
    static const int64_t Ms[] = {1, 2, 3, 7, 8, 9, 12, 13, 17, 32, 40}, Ns[] = {1, 7, 40}, Ks[] = {32, 96, 576};
    int cases = 0;
    for (int fmt = 0; fmt < 4; fmt++)
        for (size_t i = 0; i < sizeof Ms / sizeof *Ms; i++)
            for (size_t j = 0; j < sizeof Ns / sizeof *Ns; j++)
                for (size_t k = 0; k < sizeof Ks / sizeof *Ks; k++) {
                    const int with_residual = (int)((i + j + k) % 2);
                    const double worst = run_case(fmt, Ms[i], Ns[j], Ks[k], with_residual);
                    cases++;
                    if (!(worst < 1e-5)) {
                        printf("mismatch: format %d M %ld N %ld K %ld residual %d: relative error %g\n", fmt,
                               (long)Ms[i], (long)Ns[j], (long)Ks[k], with_residual, worst);
                        return 1;
                    }
                }
    /* Rows enough for both threads and several chunks (the cases above run on one thread) */
    for (int fmt = 0; fmt < 4; fmt++)
        for (int64_t M = 1; M <= 3; M += 2) {
            const double worst = run_case(fmt, M, 1000, 576, fmt % 2);
            cases++;
            if (!(worst < 1e-5)) {
                printf("mismatch: format %d M %ld N 1000 K 576: relative error %g\n", fmt, (long)M, worst);
                return 1;
            }
        }
    for (int fmt = 0; fmt < 4; fmt++)
        for (int nt = 1; nt <= 2; nt++) {
            if (!rows_alone_ok(fmt, 41, 96, nt) || !rows_alone_ok(fmt, 1001, 576, nt)) return 1;
            cases += 2;
        }
    printf("ok %d cases\n", cases);
    return 0;
}
