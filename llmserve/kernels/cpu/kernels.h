/* The CPU kernels' ABI and what their sources share. decode.c, decoder.c, gemm.c,
 * q8_rows.c and lora.c all include it and native.py builds them into one library, so
 * this file declares every function the library exports: the compiler checks each definition
 * against its declaration here, and native.py's SIGNATURES (the ctypes argument types) and
 * decoder.py's ctypes structures mirror it (tests/test_cpu_attention.py checks the
 * former). Also: the dtype codes (native.DTYPE_CODES), bfloat16 conversions and
 * 16-lane vector types. Part of the build's cache key. */
#ifndef LLMSERVE_CPU_KERNELS_H
#define LLMSERVE_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A build for AVX2 + FMA without AVX-512 (Zen 2/3, Haswell to Broadwell; or any CPU
 * with ATEN_CPU_CAPABILITY=avx2): where the kernels keep their hot loops in AVX2's own
 * 8-lane registers, as the 16-lane vectors below are two AVX2 registers each, and GCC
 * keeps arrays of them (a tile's sums) on the stack. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_ONLY 1
#include <immintrin.h>

/* 8 32-bit words of two bf16 each as float32 lanes: their low halves (the even
 * elements of a bf16 row; a (scale, zero) pair's scale) and their high halves (the odd
 * elements; the zero). A bf16 is a float's top half: one shift, one mask. */
static inline __attribute__((always_inline)) void bf16_halves8(__m256i words, __m256 *low,
                                                               __m256 *high) {
    *low = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    *high = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 consecutive bf16 values as float32 lanes. */
static inline __attribute__((always_inline)) __m256 load8_bf16(const uint16_t *src) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}
#endif

/* 16 lanes, whatever the ISA: one AVX-512 register, two AVX2 ones (GCC vector types). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64), aligned(4)));

/* 16 bfloat16 values as float32 lanes, and back (rounded to nearest even, as
 * f32_to_bf16). */
static inline v16f load16_bf16(const uint16_t *src) {
    typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
    v16u16 raw;
    memcpy(&raw, src, sizeof raw);
    v16u32 wide = __builtin_convertvector(raw, v16u32) << 16;
    v16f out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

static inline void store16_bf16(uint16_t *dst, v16f x) {
#if defined(AVX2_ONLY)
    /* in AVX2's own registers: GCC compiled the 16-lane compare below lane by lane here
     * (a vpextrd, a cmp and a setg per lane), in every kernel that stores bf16 */
    __m256i half[2];
    memcpy(half, &x, sizeof half);
    for (int h = 0; h < 2; h++) {
        const __m256i u = half[h];
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
        const __m256i nan = _mm256_cmpgt_epi32(
            _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
        const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        half[h] = _mm256_blendv_epi8(rounded, quiet, nan);
    }
    /* both halves' lanes fit 16 bits: the unsigned pack saturates nothing; it packs per
     * 128-bit lane, and the permute puts the 64-bit quarters back in order */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xD8);
    _mm256_storeu_si256((__m256i *)dst, packed);
#else
    typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
    v16u32 u;
    memcpy(&u, &x, sizeof u);
    v16u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    /* all ones where NaN; compared as signed (|u| fits) */
    v16u32 nan = (v16u32)((v16i)(u & 0x7FFFFFFFu) > 0x7F800000);
    v16u32 bits = (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);
    v16u16 out = __builtin_convertvector(bits, v16u16);
    memcpy(dst, &out, sizeof out);
#endif
}

/* decoder.c's view of a model (decoder.py's StackLinear, StackLayer, StackDims). A projection
 * is int4 (LINEAR_INT4: ATen's pack, its (scale, zero) table, a bf16 bias) or dense
 * bf16 (LINEAR_BF16: bf16_gemm_pack's panels, a float32 bias added before the one
 * rounding, as cpu_linear.NativeLinear does). */
enum { LINEAR_INT4 = 0, LINEAR_BF16 = 1 };
typedef struct {
    const uint8_t *weight;      /* int4: ATen's int4 pack; bf16: bf16_gemm_pack's panels */
    const uint16_t *scale_zero; /* int4: [K / 32, N, 2] bf16; bf16: NULL */
    const uint16_t *bias;       /* int4: [N] bf16 or NULL */
    int64_t n, k;
    const float *bias_f32;      /* [N] float32 or NULL: bf16's bias; int4's for quant_gemm */
    int format;                 /* LINEAR_INT4 or LINEAR_BF16 */
} stack_linear;

typedef struct {
    const uint16_t *input_norm, *post_norm;  /* [hidden] bf16 */
    stack_linear qkv, o, gate_up, down;
    void *kv_cache;  /* [2, blocks, block_size, kv_heads, head_dim] bf16 */
} stack_layer;

typedef struct {
    int hidden, num_heads, kv_heads, head_dim, intermediate, block_n;
    float eps, scale;
    int64_t num_cache_blocks;
    int block_size;
    int int8_x;  /* 1: products of many rows round x to int8 where built (panel_int8.h) */
    /* int4 products of this many rows or more go through gemm.c's quant_gemm, as the
     * per-op path's do (AMX and AVX512-BF16 CPUs); 0: never */
    int quant_gemm_rows;
} stack_dims;

/* The entry points (what each computes and returns: at its definition). */

/* decode.c: attention, rotary + K/V store, and the bf16 ops between the GEMMs. */
int paged_decode(int num_threads, const void *q, int64_t q_stride, void *out, const void *kv,
                 const int32_t *q_rows, const int32_t *tables, int table_stride,
                 const int32_t *first_keys, const int32_t *seq_lens, int num_seqs,
                 int64_t num_cache_blocks,
                 int block_size, int num_heads, int kv_heads, int head_dim, float scale,
                 const float *sinks, float softcap, int dtype);
int rope_and_cache(int num_threads, const void *qkv, int64_t qkv_stride, void *q_out,
                   void *kv, const float *cos, const float *sin, const int64_t *slots,
                   int num_tokens, int64_t num_cache_blocks, int block_size, int num_heads,
                   int kv_heads, int head_dim, int dtype);
int add_rms_norm_bf16(int num_threads, const uint16_t *x, const uint16_t *delta,
                      const uint16_t *weight, uint16_t *out, uint16_t *residual_out,
                      int rows, int dim, float eps);
int silu_and_mul_bf16(int num_threads, const uint16_t *gate_up, int rows, int64_t inter,
                      uint16_t *act);
int argmax_rows_bf16(int num_threads, const uint16_t *x, int rows, int64_t n, int64_t stride,
                     int64_t *out);

/* decoder.c: the decoder stack (int4 and bf16 projections), and one int4 product for
 * tests. */
int panel_int8(void);  /* the int4 block its int8 panels read, or 0 */
int q4_int8_min_rows(void);  /* the fewest rows whose int4 products round x, or 0 */
int q4_linear_bf16(int num_threads, const stack_linear *lin, int block_n, const uint16_t *x,
                   int M, uint16_t *y, int int8_x);
int stack_decode_layers(int num_threads, const stack_dims *d, const stack_layer *layers, int num_layers,
                     uint16_t *x, int M, const float *cos, const float *sin,
                     const int64_t *slots, const int32_t *tables, int table_stride,
                     const int32_t *seq_lens);

/* dequant.c: columns [c0, c1) of an int4 weight as W^T [k, c1 - c0] float32, for the
 * float32 GEMM of many rows on CPUs without bf16 arithmetic. */
int q4_dequant_f32(int num_threads, const stack_linear *lin, int block_n, int64_t c0,
                   int64_t c1, float *out);

/* gemm.c: bf16 and weight-only int4/int8 linears (stubs returning -3 where the CPU
 * lacks AVX512-BF16, which bf16_gemm_available says). */
int bf16_gemm_available(void);
int bf16_gemm(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
              const uint16_t *packed, int64_t n, int64_t k, const float *bias, uint16_t *y,
              int64_t ldy);
int bf16_gemm_pack(int num_threads, const uint16_t *w, int64_t n, int64_t k,
                   uint16_t *packed);
int quant_gemm(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
               const uint8_t *qweight, const uint16_t *scales, int bits, int64_t n, int64_t k,
               const float *bias, uint16_t *y, int64_t ldy);
/* Whether quant_gemm multiplies with AMX tiles: ``want`` 1 or 0 switches them on or off
 * (-1 only asks); 1 when in use (built for AMX, granted by the OS, and wanted). */
int gemm_use_amx(int want);

/* q8_rows.c: y [m, n] = x [m, k] (bf16) times an int8 weight-only weight [n, k] with
 * per-row bf16 scales (a few rows: a decode step's LM head). */
int panel_gemms(void);
int q8_int8_built(void);
int q8_rows_bf16(int num_threads, const uint16_t *x, int64_t m, int64_t ldx, const int8_t *q,
                 const uint16_t *scales, int64_t n, int64_t k, const float *bias, uint16_t *y,
                 int64_t ldy, int int8_x);

/* lora.c: one projection's multi-LoRA (shrink and expand of every group of rows). */
int lora_add_rows(int num_threads, const void *x, int64_t ldx, int64_t x_cols, void *y,
                  int64_t ldy, int64_t y_cols, int64_t num_rows, int dtype, const int64_t *rows,
                  const int32_t *starts, int num_groups, const void *a, const void *bt,
                  int w_dtype, int n, int r, int64_t k, const int64_t *slice_ends);

#endif
