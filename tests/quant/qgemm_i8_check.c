/* qgemm_i8_f32 checked as a standalone program (test_qgemm_i8.py builds it with each kernel variant's flags, and
   with an aarch64 cross compiler run under qemu-user for the NEON paths). Two checks per case, both against
   float64 references: (1) activations exactly on the int8 grid (each block's absmax 127 * 2^e), where the
   kernel's rounding is exact and only fp32 rounding separates it from the integer math; (2) random activations,
   within the bound of rounding each to its block's grid (|w| * d / 2 per product) of the exact product.
   Prints "ok N cases"; exit status 1 and the worst case on a failure. */
#include "../../nxdserve/csrc/kernels.c"

#include <stdio.h>

#include "greedy_check.h"

static uint64_t rng_state = 88172645463325252ull;
static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}
static float uniform(void) { return (float)next_u32() / 4294967296.f * 2.f - 1.f; } /* [-1, 1) */

static double weight(int fmt, const uint8_t* w, const float* scale, const float* offset, int64_t n, int64_t k,
                     int64_t K) {
    const int64_t nb = K / QB, b = k / QB, i = k % QB;
    if (fmt == 0) {
        const uint8_t byte = w[n * (K / 2) + b * 16 + (i % 16)];
        return (i < 16 ? byte & 0x0F : byte >> 4) * (double)scale[n * nb + b] + offset[n * nb + b];
    }
    return (int8_t)w[n * K + k] * (double)scale[n * nb + b];
}

/* Returns the worst error relative to its allowance over the outputs (< 1 passes). */
static double run_case(int fmt, int64_t M, int64_t N, int64_t K, int with_residual, int on_grid) {
    const int64_t nb = K / QB, row_bytes = fmt == 0 ? K / 2 : K;
    uint8_t* w = malloc((size_t)(N * row_bytes));
    float* scale = malloc(sizeof(float) * (size_t)(N * nb));
    float* offset = malloc(sizeof(float) * (size_t)(N * nb));
    float* x = malloc(sizeof(float) * (size_t)(M * K));
    double* grid = malloc(sizeof(double) * (size_t)(M * nb)); /* on_grid: each block's d */
    float* res = malloc(sizeof(float) * (size_t)(M * N));
    float* out = malloc(sizeof(float) * (size_t)(M * N));
    for (int64_t i = 0; i < N * row_bytes; i++) w[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < N * nb; i++) { scale[i] = 0.01f + 0.05f * (uniform() + 1.f); offset[i] = 0.1f * uniform(); }
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            float* xb = x + m * K + b * QB;
            const double d = ldexp(1.0, (int)(next_u32() % 9) - 10);
            grid[m * nb + b] = d;
            for (int i = 0; i < QB; i++)
                xb[i] = on_grid ? (float)(((int)(next_u32() % 255) - 127) * d) : uniform() * (float)(d * 127);
            if (on_grid) xb[next_u32() % QB] = (float)((next_u32() & 1 ? 127 : -127) * d); /* absmax 127 d */
            if (b == 1 && m == 0) for (int i = 0; i < QB; i++) xb[i] = 0.f; /* an all-zero block */
        }
    for (int64_t i = 0; i < M * N; i++) res[i] = uniform();
    nxd_qgemm_args a = {0};
    a.x = x; a.M = M; a.K = K; a.xs = K; a.w = w; a.scale = scale; a.offset = fmt == 0 ? offset : NULL;
    a.format = fmt; a.N = N; a.res = with_residual ? res : NULL; a.rs = N; a.out = out; a.os = N; a.nthreads = 2;
    qgemm_i8_f32(&a);
    double worst = 0.0;
    if (!greedy_tokens_match(qgemm_i8_f32, &a, out)) worst = 1e9; /* reported as a mismatch */
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double ref = with_residual ? res[m * N + n] : 0.0, mag = 1e-6, rounding = 0.0;
            for (int64_t k = 0; k < K; k++) {
                const double wv = weight(fmt, w, scale, offset, n, k, K), xv = x[m * K + k];
                ref += wv * xv;
                mag += fabs(wv * xv);
                /* x's block scale is absmax / 127, at most the d it was drawn with; half of it per element */
                rounding += fabs(wv) * grid[m * nb + k / QB] * 0.5;
            }
            const double allowed = on_grid ? 1e-5 * mag : rounding + 1e-5 * mag;
            const double err = fabs(out[m * N + n] - ref) / allowed;
            if (err > worst) worst = err;
        }
    free(w); free(scale); free(offset); free(x); free(grid); free(res); free(out);
    return worst;
}

int main(void) {
    static const int64_t Ms[] = {1, 2, 3, 7, 8, 9, 17}, Ns[] = {1, 7, 40}, Ks[] = {64, 96, 576};
    int cases = 0;
    for (int fmt = 0; fmt < 2; fmt++)
        for (int on_grid = 1; on_grid >= 0; on_grid--)
            for (size_t i = 0; i < sizeof Ms / sizeof *Ms; i++)
                for (size_t j = 0; j < sizeof Ns / sizeof *Ns; j++)
                    for (size_t k = 0; k < sizeof Ks / sizeof *Ks; k++) {
                        const int with_residual = (int)((i + j + k) % 2);
                        const double worst = run_case(fmt, Ms[i], Ns[j], Ks[k], with_residual, on_grid);
                        cases++;
                        if (!(worst < 1.0)) {
                            printf("mismatch: format %d on_grid %d M %ld N %ld K %ld residual %d: error / allowed %g\n",
                                   fmt, on_grid, (long)Ms[i], (long)Ns[j], (long)Ks[k], with_residual, worst);
                            return 1;
                        }
                    }
    printf("ok %d cases\n", cases);
    return 0;
}
