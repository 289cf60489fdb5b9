/* nxdserve's CPU kernels: every function the Python side calls through ctypes and every struct it passes.

   The Python side (nxdserve/engine/models/cpu_kernels.py) declares each struct again as a ctypes.Structure and,
   when it loads a build, compares that declaration with nxd_struct_layouts() (sizeof and offsetof of every
   field); on any difference it refuses the library and the model runs its torch ops. Keep the two in step.

   bf16 values are passed as uint16_t bit patterns; "bf16 / f32" pairs of functions differ only in the element
   type of their tensors (void* in the args structs). Parts marked AVX512-BF16 exist only in builds whose
   target has it (the avx512bf16 variant); their *_available() function says whether this build has them. */
#ifndef NXDSERVE_KERNELS_H
#define NXDSERVE_KERNELS_H

#include <stdint.h>

/* ---- threads.c ------------------------------------------------------------------------------------------ */
int omp_bind_team(int n, const int* cpus, int ncpus, int bind);

/* ---- attention.c: slot attention over the KV cache ------------------------------------------------------- */
/* q[t, hq, :] at q + t*q_st + hq*q_sh (hq = h*group + g); k/v likewise. Cache line of slot s, KV head h,
   position p at cache + s*c_ss + h*c_sh + p*head_dim. Token t (all ntok) writes its K/V at (slots[t], pos[t]);
   token sel[i] (or i when sel is NULL, i < nsel) attends to keys lo..pos[t] of its slot (lo from window > 0).
   out[t, hq*head_dim + d] at out + t*o_st + hq*head_dim + d. Strides in elements. */
typedef struct nxd_attention_args {
    const void* q;
    int64_t q_st, q_sh;
    const void* k;
    int64_t k_st, k_sh;
    const void* v;
    int64_t v_st, v_sh;
    void* k_cache;
    void* v_cache;
    int64_t c_ss, c_sh;
    const int64_t* slots;
    const int64_t* pos;
    int64_t ntok;
    const int64_t* sel;
    int64_t nsel;
    int64_t hkv, group, head_dim, window;
    void* out;
    int64_t o_st;
    float scale;
    int32_t nthreads;
    int32_t kv_fp8;  /* fp8 caches: 1 = e4m3fn, 2 = e5m2 (0 for the model-dtype kernels) */
    float v_scale;   /* fp8 caches: V's scale, applied to the output (K's is folded into scale) */
} nxd_attention_args;

void slot_attention_bf16(const nxd_attention_args* a);
void slot_attention_f32(const nxd_attention_args* a);
/* An fp8 KV cache (uint8 codes): k and v are the new tokens' codes (already cast), written as bytes. */
void slot_attention_fp8_bf16(const nxd_attention_args* a);
void slot_attention_fp8_f32(const nxd_attention_args* a);
void kv_fp8_store_f32(uint8_t* dst, const float* src, int64_t n, int32_t kv_fp8, float scale);

/* ---- elementwise.c: layer ops and argmax ------------------------------------------------------------------ */
void add_rmsnorm_bf16(const uint16_t* x, const uint16_t* delta, const uint16_t* w, float eps, uint16_t* sum,
                      uint16_t* out, int64_t rows, int64_t cols, int nthreads);
void add_rmsnorm_f32(const float* x, const float* delta, const float* w, float eps, float* sum, float* out,
                     int64_t rows, int64_t cols, int nthreads);
void rope_bf16(uint16_t* x, int64_t rs, int64_t rows, int64_t nheads, int64_t D, const uint16_t* cos,
               const uint16_t* sin, int nthreads);
void rope_f32(float* x, int64_t rs, int64_t rows, int64_t nheads, int64_t D, const float* cos, const float* sin,
              int nthreads);
void silu_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t rows, int64_t cols, int nthreads);
void silu_mul_f32(const float* gu, float* out, int64_t rows, int64_t cols, int nthreads);
void argmax_rows_bf16(const uint16_t* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out, int nthreads);
void argmax_rows_f32(const uint32_t* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out, int nthreads);

/* ---- gemm.c: bf16 GEMM on packed panels (AVX512-BF16; AMX tiles where the CPU and OS allow) -------------- */
/* out (M, N) = bf16(x (M, K) @ w^T + bias) [+ res, rounded again]; wp: the panels (gemm.pack), cw: their
   compressed copy (gemm.compress) or NULL; bias, res NULL when absent; out may be res. Strides in elements. */
typedef struct nxd_gemm_args {
    const uint16_t* x;
    int64_t M, K, xs;
    const uint16_t* wp;
    const uint8_t* cw;
    const uint16_t* bias;
    const uint16_t* res;
    int64_t rs, N;
    uint16_t* out;
    int64_t os;
    int32_t nthreads;
} nxd_gemm_args;

int gemm_available(void);
int gemm_amx(void);          /* asks the OS for AMX once; whether GEMMs use it */
int gemm_set_amx(int on);    /* AMX off (0) or back on where available (1); whether it is on */
int gemm_cw_header_size(void);
void gemm_bf16(const nxd_gemm_args* a);
void gemm_set_work_stealing(int on);
void gemm_set_x_block_bytes(int64_t bytes);

/* ---- decode.c: the fused bf16 decoder forward (AVX512-BF16) ------------------------------------------------ */
/* x (T, H) overwritten with the stack's output; lw: 16 pointers per layer (see decode.c); scratch ws (bf16)
   and fs (fp32, decode_forward_scratch(G, max pos + 1, D, kv_fp8) floats per thread); A alternatives after the
   rows, their K/V in alt_kv; keep (K increasing token indices) or NULL. kv_fp8: 0 a bf16 cache, 1 e4m3fn codes,
   2 e5m2 codes (no alternatives then), with kv_scales (L, 2): each layer's K and V scale. */
typedef struct nxd_decode_args {
    uint16_t* x;
    int64_t T;
    const uint16_t* const* lw;
    const int64_t* windows;
    int64_t L;
    const uint16_t* final_norm;
    const uint16_t* cos;
    const uint16_t* sin;
    const int64_t* slots;
    const int64_t* pos;
    int64_t H, NH, NKV, D, I, c_ss, c_sh;
    uint16_t* ws;
    float* fs;
    int64_t A;
    uint16_t* alt_kv;
    const uint16_t* silu_tab;
    const int64_t* keep;
    int64_t K;
    const float* kv_scales;
    float eps;
    int32_t nthreads;
    int32_t kv_fp8;
} nxd_decode_args;

int decode_forward_available(void);
void decode_forward_bf16(const nxd_decode_args* a);
int64_t decode_forward_scratch(int64_t G, int64_t maxctx, int64_t D, int32_t kv_fp8);
void decode_forward_fp8_store(uint8_t* dst, const uint16_t* src, int64_t n, int32_t kv_fp8, float scale);
void decode_forward_fp8_widen(const uint8_t* src, uint16_t* dst, int64_t n, int32_t kv_fp8);
void decode_forward_set_block_min(int64_t n);
int64_t decode_forward_block_min(void);
void decode_forward_silu_mul(const uint16_t* tab, const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n);

/* ---- greedy_head.c: argmax of an LM head's bf16 logits without the logits (AVX512-BF16 + VNNI) ------------ */
/* See greedy_head.c for the screen's layout. Returns the columns computed again in bf16, -1 if a row was not
   finite (its out is -1), -2 without memory. */
typedef struct nxd_greedy_head_args {
    const uint16_t* x;
    int64_t M, K, xs;
    const int32_t* rest;
    int64_t KR;
    const int32_t* S;
    int64_t KS;
    const int8_t* wq;
    const uint16_t* ws;
    const float* const* colp;
    const int32_t* csum;
    const uint16_t* wfull;
    int64_t N;
    int64_t* out;
    uint8_t* xq;
    uint16_t* xsb;
    float* rowf;
    int32_t* list_idx;
    float* list_hi;
    int32_t nthreads;
} nxd_greedy_head_args;

int greedy_head_available(void);
int64_t greedy_head_argmax(const nxd_greedy_head_args* a);

/* ---- qgemm.c: quantized-weight GEMM for a few rows (every variant; AVX2+FMA code where the target has it) ---- */
/* out (M, N) = x (M, K) @ W^T [+ res], fp32; K a multiple of 32. format 0 = q4: w (N, K/2) bytes, GGUF's nibble
   order per 32-block, scale and offset (N, K/32); 1 = q8: w (N, K) int8, scale (N, K/32), offset NULL; 2 = fp8
   e4m3fn: w (N, K) codes, scale (N, K/32), offset NULL; 3 = bf16: w (N, K) bf16 values, scale and offset NULL.
   res NULL when absent. Strides in elements. */
typedef struct nxd_qgemm_args {
    const float* x;
    int64_t M, K, xs;
    const uint8_t* w;
    const float* scale;
    const float* offset;
    const float* res;
    int64_t rs, N;
    float* out;
    int64_t os;
    int32_t format;
    int32_t nthreads;
    /* Optional greedy tokens (NULL: none): argmax[m] = the first column below argmax_cols holding row m's largest
       output, in argmax_rows' order; the outputs are written as without it. */
    int64_t* argmax;
    int64_t argmax_cols;
} nxd_qgemm_args;

void qgemm_f32(const nxd_qgemm_args* a);
int qgemm_paired_available(void); /* 1 where the build has the paired rows for many rows of x */
int qgemm_paired_max_rows(void);  /* the most rows of x an fp32 call takes on them (0: none) */
int qgemm_i8_max_rows(void);  /* int8 activations serve calls of fewer rows of x than this; more: fp32 (0: all) */
/* dst (N, K) fp32 = the weight of a's format (w, scale, offset, K, N, format, nthreads read), widened. */
void q_widen_f32(const nxd_qgemm_args* a, float* dst);

/* ---- qdecode.c: the fused forward of a quantized decoder stack for a few rows (every variant) --------------- */
/* x (T, H) fp32, overwritten with the stack's output (final-normed where final_norm is not NULL). lw:
   QDECODE_LAYER_POINTERS pointers per layer, in qdecode.c's order: input norm; qkv codes, scales, offsets, bias;
   o likewise; post norm; gate_up likewise (gate rows 0..I-1, up rows I..2I-1); down likewise; K and V cache of the
   layer (fp32, line of slot s, KV head h, position p at cache + s*c_ss + h*c_sh + p*D). Offsets (q4 only) and
   biases NULL when absent. formats: 4 per layer (qkv, o, gate_up, down), qgemm's format numbers; every K a multiple
   of 32. cos/sin (T, D): each row's rotary table row. windows (L) or NULL: sliding windows (0: none). Row t writes
   its K/V at (slots[t], pos[t]) and attends to its slot's keys up to pos[t]. The last A rows are draft
   alternatives (fused_decode's DraftAlternatives): each sees its slot's keys before pos[t] and its own K/V, which
   go to alt_kv (L, A, 2, NKV, D) fp32 instead of the cache. int8_activations: the 4-bit and int8 linears take
   their inputs rounded to int8 per 32 columns and integer dot products (qgemm_i8.c). */
#define QDECODE_LAYER_POINTERS 20
typedef struct nxd_qdecode_args {
    float* x;
    int64_t T;
    const void* const* lw;
    const int32_t* formats;
    const int64_t* windows;
    int64_t L;
    const float* final_norm;
    const float* cos;
    const float* sin;
    const int64_t* slots;
    const int64_t* pos;
    int64_t H, NH, NKV, D, I, c_ss, c_sh;
    const float* kv_scales; /* (L, 2) K and V scales of an fp8 cache */
    float* alt_kv;
    int64_t A;
    float eps;
    int32_t nthreads;
    int32_t int8_activations;
    int32_t kv_fp8; /* 0 an fp32 cache, 1 e4m3fn codes, 2 e5m2 codes */
} nxd_qdecode_args;

void qdecode_forward_f32(const nxd_qdecode_args* a);

/* ---- lora.c: multi-LoRA shrink + expand of one linear, each row on its own adapter ------------------------ */
/* x (M, K), row m at x + m*xs; idx[m]: row m's adapter (-1: none, its out row untouched); a (n_adapters, S*rmax,
   K) and b = B transposed (n_adapters, rmax, N), both contiguous, for S packed modules whose output columns are
   starts[p]..starts[p+1] (S+1 entries, starts[S] = N); adapter i reads only the first ranks[i] (<= rmax) rows of
   each module's rmax in a and of b; scale (n_adapters) or NULL (1). out (M, N), row m at out + m*os, gets
   += scale * B A x in place. */
typedef struct nxd_lora_args {
    const void* x;
    int64_t M, K, xs;
    const int32_t* idx;
    const void* a;
    const void* b;
    const float* scale;
    const int32_t* ranks;
    const int64_t* starts;
    int64_t S, rmax, N;
    void* out;
    int64_t os;
    int32_t nthreads;
} nxd_lora_args;

void lora_add_bf16(const nxd_lora_args* a);
void lora_add_f32(const nxd_lora_args* a);

/* ---- qgemm_i8.c: qgemm_f32's contract on integer dot products (x rounded to int8 per 32-block; opt-in) ----- */
/* The args of qgemm_f32; formats 0 (q4) and 1 (q8) computed as int8 x int4/int8 dot products, each block's
   product scaled once in fp32 (see qgemm_i8.c for the rounding); format 2 (fp8) runs qgemm_f32. */
void qgemm_i8_f32(const nxd_qgemm_args* a);

/* ---- qsearch.c: the quantizers' scale searches at load (quant.py) ------------------------------------------ */
/* w (N, K) fp32 contiguous, K a multiple of group; scale (and offset for int4) (N, K / group) written. kind 0 = int4
   (group <= 128; cand: the candidate steps' 15 + d), 1 = fp8 e4m3 (cand: the multipliers of absmax / 448).
   importance (K) > 0 or NULL: int4's squared errors weighted per input column. */
typedef struct nxd_qsearch_args {
    const float* w;
    int64_t N, K, group;
    const float* cand;
    int64_t ncand;
    const float* importance;
    float* scale;
    float* offset;
    int32_t kind;
    int32_t nthreads;
} nxd_qsearch_args;

void quant_search_f32(const nxd_qsearch_args* a);

/* GPTQ's column loop (gptq.py): w (N, K) fp32 contiguous, updated in place, K a multiple of group (<= 128); u (K, K)
   the upper Cholesky factor of the damped H^-1; cand as int4's above. Writes codes (N, K) 0..15, scale and offset
   (N, K / group). */
typedef struct nxd_gptq_args {
    float* w;
    int64_t N, K, group;
    const float* u;
    const float* cand;
    int64_t ncand;
    uint8_t* codes;
    float* scale;
    float* offset;
    int32_t nthreads;
} nxd_gptq_args;

void gptq_int4_f32(const nxd_gptq_args* a);

/* ---- kernels.c: the layout check ---------------------------------------------------------------------------- */
/* One entry per field of every struct above (field = its name), plus one per struct with field NULL and size
   = sizeof(struct). */
typedef struct nxd_field_layout {
    const char* type;
    const char* field;
    int64_t offset;
    int64_t size;
} nxd_field_layout;

const nxd_field_layout* nxd_struct_layouts(int64_t* count);

#endif
