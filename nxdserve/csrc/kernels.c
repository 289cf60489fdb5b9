/* nxdserve's CPU kernels, built as ONE translation unit from the parts included below (cpu_build.py compiles
   this file alone, once per ISA variant). One unit, not one object per part, because the parts share static
   helpers that must inline into each other's hot loops as they did when this was a single source: the fused
   forward (decode.c) and the greedy head (greedy_head.c) run the GEMM's register tiles (gemm.c), and every part
   uses the bf16 conversions below. The exported functions and structs are declared in nxdserve_kernels.h. */
#define _GNU_SOURCE /* sched_setaffinity */
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#include "nxdserve_kernels.h"

static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {  /* round to nearest even, like torch */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#define F32(x) (x)
/* A value rounded to the model dtype, as torch's eager ops round every result. */
#define R_bf16(x) bf2f(f2bf(x))
#define R_f32(x) (x)

#include "threads.c"
#include "attention.c"
#include "elementwise.c"
#include "gemm.c"
#include "decode.c"
#include "greedy_head.c"
#include "qgemm.c"
#include "qgemm_i8.c"
#include "qdecode.c" /* after both GEMMs: it calls their row kernels */
#include "lora.c"
#include "qsearch.c"

#define NXD_FIELD(T, F) {#T, #F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T*)0)->F)}
#define NXD_SIZE(T) {#T, NULL, 0, (int64_t)sizeof(T)}
static const nxd_field_layout nxd_layouts[] = {
    NXD_SIZE(nxd_attention_args),
    NXD_FIELD(nxd_attention_args, q), NXD_FIELD(nxd_attention_args, q_st), NXD_FIELD(nxd_attention_args, q_sh),
    NXD_FIELD(nxd_attention_args, k), NXD_FIELD(nxd_attention_args, k_st), NXD_FIELD(nxd_attention_args, k_sh),
    NXD_FIELD(nxd_attention_args, v), NXD_FIELD(nxd_attention_args, v_st), NXD_FIELD(nxd_attention_args, v_sh),
    NXD_FIELD(nxd_attention_args, k_cache), NXD_FIELD(nxd_attention_args, v_cache),
    NXD_FIELD(nxd_attention_args, c_ss), NXD_FIELD(nxd_attention_args, c_sh),
    NXD_FIELD(nxd_attention_args, slots), NXD_FIELD(nxd_attention_args, pos), NXD_FIELD(nxd_attention_args, ntok),
    NXD_FIELD(nxd_attention_args, sel), NXD_FIELD(nxd_attention_args, nsel),
    NXD_FIELD(nxd_attention_args, hkv), NXD_FIELD(nxd_attention_args, group),
    NXD_FIELD(nxd_attention_args, head_dim), NXD_FIELD(nxd_attention_args, window),
    NXD_FIELD(nxd_attention_args, out), NXD_FIELD(nxd_attention_args, o_st),
    NXD_FIELD(nxd_attention_args, scale), NXD_FIELD(nxd_attention_args, nthreads),
    NXD_FIELD(nxd_attention_args, kv_fp8), NXD_FIELD(nxd_attention_args, v_scale),

    NXD_SIZE(nxd_gemm_args),
    NXD_FIELD(nxd_gemm_args, x), NXD_FIELD(nxd_gemm_args, M), NXD_FIELD(nxd_gemm_args, K),
    NXD_FIELD(nxd_gemm_args, xs), NXD_FIELD(nxd_gemm_args, wp), NXD_FIELD(nxd_gemm_args, cw),
    NXD_FIELD(nxd_gemm_args, bias), NXD_FIELD(nxd_gemm_args, res), NXD_FIELD(nxd_gemm_args, rs),
    NXD_FIELD(nxd_gemm_args, N), NXD_FIELD(nxd_gemm_args, out), NXD_FIELD(nxd_gemm_args, os),
    NXD_FIELD(nxd_gemm_args, nthreads),

    NXD_SIZE(nxd_decode_args),
    NXD_FIELD(nxd_decode_args, x), NXD_FIELD(nxd_decode_args, T), NXD_FIELD(nxd_decode_args, lw),
    NXD_FIELD(nxd_decode_args, windows), NXD_FIELD(nxd_decode_args, L), NXD_FIELD(nxd_decode_args, final_norm),
    NXD_FIELD(nxd_decode_args, cos), NXD_FIELD(nxd_decode_args, sin), NXD_FIELD(nxd_decode_args, slots),
    NXD_FIELD(nxd_decode_args, pos), NXD_FIELD(nxd_decode_args, H), NXD_FIELD(nxd_decode_args, NH),
    NXD_FIELD(nxd_decode_args, NKV), NXD_FIELD(nxd_decode_args, D), NXD_FIELD(nxd_decode_args, I),
    NXD_FIELD(nxd_decode_args, c_ss), NXD_FIELD(nxd_decode_args, c_sh), NXD_FIELD(nxd_decode_args, ws),
    NXD_FIELD(nxd_decode_args, fs), NXD_FIELD(nxd_decode_args, A), NXD_FIELD(nxd_decode_args, alt_kv),
    NXD_FIELD(nxd_decode_args, silu_tab), NXD_FIELD(nxd_decode_args, keep), NXD_FIELD(nxd_decode_args, K),
    NXD_FIELD(nxd_decode_args, kv_scales), NXD_FIELD(nxd_decode_args, eps), NXD_FIELD(nxd_decode_args, nthreads),
    NXD_FIELD(nxd_decode_args, kv_fp8),

    NXD_SIZE(nxd_greedy_head_args),
    NXD_FIELD(nxd_greedy_head_args, x), NXD_FIELD(nxd_greedy_head_args, M), NXD_FIELD(nxd_greedy_head_args, K),
    NXD_FIELD(nxd_greedy_head_args, xs), NXD_FIELD(nxd_greedy_head_args, rest), NXD_FIELD(nxd_greedy_head_args, KR),
    NXD_FIELD(nxd_greedy_head_args, S), NXD_FIELD(nxd_greedy_head_args, KS), NXD_FIELD(nxd_greedy_head_args, wq),
    NXD_FIELD(nxd_greedy_head_args, ws), NXD_FIELD(nxd_greedy_head_args, colp),
    NXD_FIELD(nxd_greedy_head_args, csum), NXD_FIELD(nxd_greedy_head_args, wfull),
    NXD_FIELD(nxd_greedy_head_args, N), NXD_FIELD(nxd_greedy_head_args, out), NXD_FIELD(nxd_greedy_head_args, xq),
    NXD_FIELD(nxd_greedy_head_args, xsb), NXD_FIELD(nxd_greedy_head_args, rowf),
    NXD_FIELD(nxd_greedy_head_args, list_idx), NXD_FIELD(nxd_greedy_head_args, list_hi),
    NXD_FIELD(nxd_greedy_head_args, nthreads),

    NXD_SIZE(nxd_qgemm_args),
    NXD_FIELD(nxd_qgemm_args, x), NXD_FIELD(nxd_qgemm_args, M), NXD_FIELD(nxd_qgemm_args, K),
    NXD_FIELD(nxd_qgemm_args, xs), NXD_FIELD(nxd_qgemm_args, w), NXD_FIELD(nxd_qgemm_args, scale),
    NXD_FIELD(nxd_qgemm_args, offset), NXD_FIELD(nxd_qgemm_args, res), NXD_FIELD(nxd_qgemm_args, rs),
    NXD_FIELD(nxd_qgemm_args, N), NXD_FIELD(nxd_qgemm_args, out), NXD_FIELD(nxd_qgemm_args, os),
    NXD_FIELD(nxd_qgemm_args, format), NXD_FIELD(nxd_qgemm_args, nthreads), NXD_FIELD(nxd_qgemm_args, argmax),
    NXD_FIELD(nxd_qgemm_args, argmax_cols),

    NXD_SIZE(nxd_qdecode_args),
    NXD_FIELD(nxd_qdecode_args, x), NXD_FIELD(nxd_qdecode_args, T), NXD_FIELD(nxd_qdecode_args, lw),
    NXD_FIELD(nxd_qdecode_args, formats), NXD_FIELD(nxd_qdecode_args, windows), NXD_FIELD(nxd_qdecode_args, L),
    NXD_FIELD(nxd_qdecode_args, final_norm), NXD_FIELD(nxd_qdecode_args, cos), NXD_FIELD(nxd_qdecode_args, sin),
    NXD_FIELD(nxd_qdecode_args, slots), NXD_FIELD(nxd_qdecode_args, pos), NXD_FIELD(nxd_qdecode_args, H),
    NXD_FIELD(nxd_qdecode_args, NH), NXD_FIELD(nxd_qdecode_args, NKV), NXD_FIELD(nxd_qdecode_args, D),
    NXD_FIELD(nxd_qdecode_args, I), NXD_FIELD(nxd_qdecode_args, c_ss), NXD_FIELD(nxd_qdecode_args, c_sh),
    NXD_FIELD(nxd_qdecode_args, kv_scales), NXD_FIELD(nxd_qdecode_args, alt_kv), NXD_FIELD(nxd_qdecode_args, A),
    NXD_FIELD(nxd_qdecode_args, eps), NXD_FIELD(nxd_qdecode_args, nthreads),
    NXD_FIELD(nxd_qdecode_args, int8_activations), NXD_FIELD(nxd_qdecode_args, kv_fp8),

    NXD_SIZE(nxd_lora_args),
    NXD_FIELD(nxd_lora_args, x), NXD_FIELD(nxd_lora_args, M), NXD_FIELD(nxd_lora_args, K),
    NXD_FIELD(nxd_lora_args, xs), NXD_FIELD(nxd_lora_args, idx), NXD_FIELD(nxd_lora_args, a),
    NXD_FIELD(nxd_lora_args, b), NXD_FIELD(nxd_lora_args, scale), NXD_FIELD(nxd_lora_args, ranks),
    NXD_FIELD(nxd_lora_args, starts), NXD_FIELD(nxd_lora_args, S), NXD_FIELD(nxd_lora_args, rmax),
    NXD_FIELD(nxd_lora_args, N),
    NXD_FIELD(nxd_lora_args, out), NXD_FIELD(nxd_lora_args, os), NXD_FIELD(nxd_lora_args, nthreads),

    NXD_SIZE(nxd_qsearch_args),
    NXD_FIELD(nxd_qsearch_args, w), NXD_FIELD(nxd_qsearch_args, N), NXD_FIELD(nxd_qsearch_args, K),
    NXD_FIELD(nxd_qsearch_args, group), NXD_FIELD(nxd_qsearch_args, cand), NXD_FIELD(nxd_qsearch_args, ncand),
    NXD_FIELD(nxd_qsearch_args, importance),
    NXD_FIELD(nxd_qsearch_args, scale), NXD_FIELD(nxd_qsearch_args, offset), NXD_FIELD(nxd_qsearch_args, kind),
    NXD_FIELD(nxd_qsearch_args, nthreads),

    NXD_SIZE(nxd_gptq_args),
    NXD_FIELD(nxd_gptq_args, w), NXD_FIELD(nxd_gptq_args, N), NXD_FIELD(nxd_gptq_args, K),
    NXD_FIELD(nxd_gptq_args, group), NXD_FIELD(nxd_gptq_args, u), NXD_FIELD(nxd_gptq_args, cand),
    NXD_FIELD(nxd_gptq_args, ncand), NXD_FIELD(nxd_gptq_args, codes), NXD_FIELD(nxd_gptq_args, scale),
    NXD_FIELD(nxd_gptq_args, offset), NXD_FIELD(nxd_gptq_args, nthreads),
};

const nxd_field_layout* nxd_struct_layouts(int64_t* count) {
    *count = (int64_t)(sizeof(nxd_layouts) / sizeof(nxd_layouts[0]));
    return nxd_layouts;
}
