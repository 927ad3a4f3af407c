/* The whole decoder stack of an int4 or bf16 model for one decode step, in one call.
 *
 * A decode step of a small model on a CPU spends as long in Python between ops
 * (~25 a layer) as in the ops themselves. Here every layer runs in C: RMSNorm, the
 * projections (read where the model keeps them, so there is one copy), rotary + the
 * K/V store, paged attention, SiLU-and-multiply and the residual adds, rounded to
 * bfloat16 at the same points as the torch path. A dense bf16 projection is gemm.c's
 * bf16_gemm on its packed panels, the per-op path's own call; the int4 products are
 * this file's.
 *
 * int4 weights are ATen's CPU int4 pack (``_convert_weight_to_int4pack_for_cpu``): blocks
 * of BN output columns, [N / BN, K, BN / 2] bytes, byte j of row k holding column j in
 * its low nibble and column j + BN / 2 in its high one (BN 64 where ATen is built for
 * AVX-512, 32 for AVX2; decoder.py checks which at start-up), with a [K / 32, N, 2]
 * bfloat16 (scale, zero) table: w = (q - 8) * scale + zero.
 * Built with decode.c and gemm.c into one library by native.py; the structures it
 * reads (stack_linear, stack_layer, stack_dims) are declared in kernels.h.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "kernels.h"
#include "panel.h"
#include "panel_int8.h"

#define GROUP 32  /* int4 group size along K (quantization.INT4_GROUP) */
/* Tokens sharing one read of a weight chunk (q4_pass): their 2 TILE vectors of sums,
 * the 2 columns and a broadcast x fill AVX-512's 32 registers; on AVX2 a tile of 4 is
 * taken 2 tokens a pass (q4_pass_avx2). */
#if defined(__AVX512F__)
#define TILE 8
#else
#define TILE 4
#endif

/* 16 bytes zero-extended to 16 int32 lanes (GCC's generic conversion would load them
 * one by one). */
static inline v16i widen16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m256i halves[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                         _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
    v16i out;
    memcpy(&out, halves, sizeof out);
    return out;
#else
    v16i out;
    for (int i = 0; i < 16; i++) out[i] = p[i];
    return out;
#endif
}

/* acc + (scale * part + offset_x), with scale * part + offset_x one fused
 * multiply-add where there is one: spelt out, as the compiler's contraction chose
 * between the two products by the register pressure of each tile size. */
static inline v16f scaled_add(v16f acc, v16f scale, v16f part, v16f offset_x) {
#if defined(__AVX512F__)
    return acc + (v16f)_mm512_fmadd_ps((__m512)scale, (__m512)part, (__m512)offset_x);
#elif defined(__FMA__)
    __m256 s[2], p[2], o[2];
    memcpy(s, &scale, sizeof s);
    memcpy(p, &part, sizeof p);
    memcpy(o, &offset_x, sizeof o);
    __m256 sum[2] = {_mm256_fmadd_ps(s[0], p[0], o[0]), _mm256_fmadd_ps(s[1], p[1], o[1])};
    v16f out;
    memcpy(&out, sum, sizeof out);
    return acc + out;
#else
    return acc + (scale * part + offset_x);
#endif
}

/* The low nibble of each lane as a float. On AVX-512 one VPERMPS from the table of
 * 0..15, which reads only an index's low 4 bits: it replaces a mask and a conversion
 * (the one-token pass is bound by these ops, not by memory). */
static inline v16f nibble_values(v16i lanes) {
#if defined(__AVX512F__)
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (v16f)_mm512_permutexvar_ps((__m512i)lanes, values);
#else
    return __builtin_convertvector(lanes & 15, v16f);
#endif
}

/* acc + col * x[0]. On AVX-512 one FMA that broadcasts x from memory itself: GCC
 * broadcasts into a register first, an extra vector op per token and k (Zen 4). */
static inline v16f fma_x(v16f acc, v16f col, const float *x) {
#if defined(__AVX512F__)
    __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(col), "m"(*x));
    return acc;
#else
    return acc + *x * col;
#endif
}

/* How far ahead a pass prefetches its weight stream, in bytes: on a 2-core Xeon
 * (Sapphire Rapids) the hardware prefetcher alone streamed a thread's weights at about
 * half the memory bandwidth. */
#define Q4_PREFETCH 4096

/* A pass over nc (1 or 2) consecutive chunks of a weight block for m tokens. Chunk c
 * of a block of BN columns is bytes 16c..16c+15 of each k row: 16 columns in its low
 * nibbles (the block's first column + 16c on) and 16 in its high ones (BN / 2 further
 * on). A pass's 2 nc vectors of sums per token (acc[t][j]: chunk j's low columns,
 * acc[t][nc + j] its high ones) must stay in registers with the columns: one chunk
 * lets TILE tokens share each dequantised weight, two chunks (a whole BN 64 block)
 * halve the broadcasts of x for tiles small enough to fit. Per group, the dot products
 * with the integer codes, then scale and zero, since
 * sum_k x_k ((q_k - 8) s + z) = s sum_k x_k q_k + (z - 8 s) sum_k x_k.
 * w: the first chunk's byte in row 0 (rows BN / 2 bytes apart); col0 its first column. */
static inline __attribute__((always_inline)) void q4_pass(
        const float *xf, const float *xsum, const int m, const int nc, int64_t K, int64_t N,
        int BN, const uint8_t *w, const uint16_t *sz, int64_t col0, v16f acc[TILE][4]) {
    const int half = BN / 2, groups = (int)(K / GROUP);
    for (int t = 0; t < m; t++)
        for (int v = 0; v < 2 * nc; v++) acc[t][v] = (v16f){0};
    for (int g = 0; g < groups; g++) {
        v16f part[TILE][4];
        for (int t = 0; t < m; t++)
            for (int v = 0; v < 2 * nc; v++) part[t][v] = (v16f){0};
        const uint8_t *b = w + (int64_t)g * GROUP * half;
        const float *xg = xf + g * GROUP;
        for (int kk = 0; kk < GROUP; kk++, b += half) {
            /* The weight Q4_PREFETCH bytes on (a thread's blocks are one stream), a line
             * per 64 bytes: see Q4_PREFETCH. */
            if (((kk * half) & 63) == 0)  /* may lie past the weight: prefetches never fault */
                __builtin_prefetch((const void *)((uintptr_t)b + Q4_PREFETCH), 0, 3);
            v16f col[4];
            for (int j = 0; j < nc; j++) {
                v16i bytes = widen16(b + 16 * j);
                col[j] = nibble_values(bytes);
                col[nc + j] = nibble_values(bytes >> 4);
            }
            for (int t = 0; t < m; t++)
                for (int v = 0; v < 2 * nc; v++)
                    part[t][v] = fma_x(part[t][v], col[v], &xg[t * K + kk]);
        }
        /* (scale, zero) bf16 pairs as one 32-bit word each: bf16 is float's top half */
        const uint16_t *szg = sz + ((int64_t)g * N + col0) * 2;
        for (int v = 0; v < 2 * nc; v++) {
            const int offset_cols = (v < nc ? 0 : half) + 16 * (v % nc);
            v16u32 pair;
            memcpy(&pair, szg + 2 * offset_cols, sizeof pair);  /* bf16 storage, as words */
            v16f scale = (v16f)(pair << 16), zero = (v16f)(pair & 0xFFFF0000u);
            v16f offset = zero - 8.0f * scale;
            for (int t = 0; t < m; t++)
                acc[t][v] = scaled_add(acc[t][v], scale, part[t][v],
                                       offset * xsum[t * groups + g]);
        }
    }
}

#if defined(AVX2_ONLY)
/* q4_pass for AVX2 builds and ATen's AVX2 pack (BN 32: one chunk is the whole block),
 * m <= 2 tokens, in AVX2's own 8-lane registers: q4_pass's 16-lane vectors are two
 * registers each, and GCC keeps arrays of them on the stack (8x slower than ATen at
 * one token). The same arithmetic in the same order as q4_pass (the per-group sums
 * of q x, then scale and zero); the running sums
 * stay in memory (L1), touched once a group, so the group's 4 m sums, the 4 column
 * vectors and a broadcast fit the 16 registers. */
static inline __attribute__((always_inline)) void q4_pass_avx2(
        const float *xf, const float *xsum, const int m, int64_t K, int64_t N,
        const uint8_t *w, const uint16_t *sz, int64_t col0, v16f acc[][4]) {
    const int groups = (int)(K / GROUP);
    const __m256i low4 = _mm256_set1_epi32(15);
    float sums[2][32] = {{0}};  /* token t: the block's 16 low columns, then its 16 high */
    for (int g = 0; g < groups; g++) {
        __m256 part[2][4];
        for (int t = 0; t < m; t++)
            for (int v = 0; v < 4; v++) part[t][v] = _mm256_setzero_ps();
        const uint8_t *b = w + (int64_t)g * GROUP * 16;
        const float *xg = xf + g * GROUP;
        for (int kk = 0; kk < GROUP; kk++, b += 16) {
            if ((kk & 3) == 0)  /* a line per 64 bytes, Q4_PREFETCH ahead (never faults) */
                __builtin_prefetch((const void *)((uintptr_t)b + Q4_PREFETCH), 0, 3);
            const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
            const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
            const __m256 col[4] = {
                _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)),
                _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
            for (int t = 0; t < m; t++) {
                const __m256 x = _mm256_broadcast_ss(&xg[t * K + kk]);
                for (int v = 0; v < 4; v++) part[t][v] = _mm256_fmadd_ps(x, col[v], part[t][v]);
            }
        }
        const uint16_t *szg = sz + ((int64_t)g * N + col0) * 2;  /* (scale, zero) words */
        for (int v = 0; v < 4; v++) {
            const __m256i pair = _mm256_loadu_si256((const __m256i *)(szg + 16 * v));
            __m256 scale, zero;
            bf16_halves8(pair, &scale, &zero);
            const __m256 offset = _mm256_sub_ps(zero, _mm256_mul_ps(_mm256_set1_ps(8.0f), scale));
            for (int t = 0; t < m; t++) {
                const __m256 offset_x = _mm256_mul_ps(offset, _mm256_set1_ps(xsum[t * groups + g]));
                float *out = sums[t] + 8 * v;
                _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out),
                                                    _mm256_fmadd_ps(scale, part[t][v], offset_x)));
            }
        }
    }
    for (int t = 0; t < m; t++) {
        memcpy(&acc[t][0], sums[t], sizeof acc[t][0]);
        memcpy(&acc[t][1], sums[t] + 16, sizeof acc[t][1]);
    }
}
#endif

/* Most tokens a two-chunk pass takes: 4 m sums + 4 columns + a broadcast in registers. */
#define TILE2 (TILE < 6 ? TILE : 6)

/* A pass for a tile of m tokens, with m and nc known to the compiler. */
static void q4_tile(const float *xf, const float *xsum, int m, int nc, int64_t K, int64_t N,
                    int BN, const uint8_t *w, const uint16_t *sz, int64_t col0,
                    v16f acc[TILE][4]) {
#if defined(AVX2_ONLY)
    if (BN == 32) {  /* (nc is 1: a chunk is the whole block) tokens two at a time */
        const int64_t groups = K / GROUP;
        for (int t0 = 0; t0 < m; t0 += 2) {
            if (m - t0 == 1)
                q4_pass_avx2(xf + t0 * K, xsum + t0 * groups, 1, K, N, w, sz, col0, acc + t0);
            else
                q4_pass_avx2(xf + t0 * K, xsum + t0 * groups, 2, K, N, w, sz, col0, acc + t0);
        }
        return;
    }
#endif
#define Q4_CASE(M_, NC_)                                                        \
    case M_ * 2 + NC_ - 1:                                                      \
        q4_pass(xf, xsum, M_, NC_, K, N, BN, w, sz, col0, acc);                 \
        break;
#define Q4_CASES(M_) Q4_CASE(M_, 1) Q4_CASE(M_, 2)
    switch (m * 2 + nc - 1) {
        Q4_CASES(1) Q4_CASES(2) Q4_CASES(3) Q4_CASES(4)
#if TILE == 8
        Q4_CASES(5) Q4_CASES(6) Q4_CASE(7, 1) Q4_CASE(8, 1)
#endif
    }
#undef Q4_CASES
#undef Q4_CASE
}

/* acc (a pass's sums: see q4_pass) rounded to bf16 into y's columns, then + bias,
 * rounded again, as the torch path adds it. */
static void q4_store(const stack_linear *lin, int BN, const v16f acc[TILE][4], int m, int nc,
                     int64_t col0, uint16_t *y) {
    for (int t = 0; t < m; t++)
        for (int v = 0; v < 2 * nc; v++) {
            const int64_t col = col0 + (v < nc ? 0 : BN / 2) + 16 * (v % nc);
            uint16_t *out = y + t * lin->n + col;
            store16_bf16(out, acc[t][v]);
            if (lin->bias != NULL)  /* f32_to_bf16(bf16 y + bf16 bias), as one vector */
                store16_bf16(out, load16_bf16(out) + load16_bf16(lin->bias + col));
        }
}

/* Chunks [first, end) of the weight for all M tokens: runs of a block's two chunks in
 * one pass where the tile fits (TILE2), else one chunk a pass. */
static void q4_chunks(const stack_linear *lin, int BN, int M, const float *xf, const float *xsum,
                      int64_t first, int64_t end, uint16_t *y) {
    const int64_t K = lin->k, groups = K / GROUP;
    const int per_block = BN / 32, half = BN / 2;
    v16f acc[TILE][4];
    for (int64_t i = first; i < end;) {
        const int64_t nb = i / per_block, c = i % per_block;
        const int whole = c == 0 && per_block == 2 && i + 2 <= end;  /* both chunks here */
        for (int t0 = 0; t0 < M; t0 += TILE) {
            const int m = M - t0 < TILE ? M - t0 : TILE;
            const int nc = whole && m <= TILE2 ? 2 : 1;
            for (int j = 0; j < (whole ? 2 : 1); j += nc) {
                const int64_t col0 = nb * BN + 16 * (c + j);
                q4_tile(xf + t0 * K, xsum + t0 * groups, m, nc, K, lin->n, BN,
                        lin->weight + nb * K * half + 16 * (c + j), lin->scale_zero, col0, acc);
                q4_store(lin, BN, acc, m, nc, col0, y + t0 * lin->n);
            }
        }
        i += whole ? 2 : 1;
    }
}

#if defined(PANEL_GEMMS)
/* From Q4_PANEL_ROWS rows with x not rounded to int8, on CPUs without bf16 arithmetic
 * (AVX-512 Ice Lake and older Xeons, AVX2; where there is some, quant_gemm's bf16 tiles
 * or the int8 panels take these products, and this runs only where both are off): a
 * GEMM over panels of the weight dequantised to float32 (panel.h), each once for all
 * the rows, where q4_pass dequantises it again for each tile of TILE rows. A panel is
 * one half of a block of Q4_PANEL_BN (2 PANEL_COLS) columns, ATen's block on the ISA
 * panel.h is built for: its low nibbles (the block's first PANEL_COLS columns) or its
 * high ones. Ice Lake Xeon, 2 threads (benchmarks/cpu/cpu_decoder.py): 1.2x the tiles at
 * 16-24 rows, 1.2-1.6x at 32; the decode step of 32 sequences ~1.1x. */
#define Q4_PANEL_ROWS 16
#define Q4_PANEL_BN (2 * PANEL_COLS)

/* panel [k1 - k0, PANEL_COLS] = W^T's columns of half h of block nb over k in [k0, k1):
 * w = q scale + (zero - 8 scale), as dequant.c computes it. */
static void q4_panel(const stack_linear *lin, int64_t nb, int h, int64_t k0, int64_t k1,
                     float *panel) {
    const int64_t K = lin->k, N = lin->n, col0 = nb * Q4_PANEL_BN + PANEL_COLS * h;
    const uint8_t *w = lin->weight + nb * K * PANEL_COLS;
#if PANEL_VECS == 2
    v16f scale[PANEL_VECS], offset[PANEL_VECS];
    for (int64_t kk = k0; kk < k1; kk++) {
        if (kk == k0 || kk % GROUP == 0) {  /* the group's (scale, zero) pairs as words */
            const uint16_t *sz = lin->scale_zero + ((kk / GROUP) * N + col0) * 2;
            for (int v = 0; v < PANEL_VECS; v++) {
                v16u32 pair;
                memcpy(&pair, sz + 32 * v, sizeof pair);
                scale[v] = (v16f)(pair << 16);
                offset[v] = (v16f)(pair & 0xFFFF0000u) - 8.0f * scale[v];
            }
        }
        for (int v = 0; v < PANEL_VECS; v++) {
            v16i bytes = widen16(w + kk * PANEL_COLS + 16 * v);
            v16f value = nibble_values(h ? bytes >> 4 : bytes) * scale[v] + offset[v];
            memcpy(panel + (kk - k0) * PANEL_COLS + 16 * v, &value, sizeof value);
        }
    }
#else
    /* AVX2, in its own 8-lane registers (16-lane vectors would live on the stack): the
     * panel's 16 columns are the 16 bytes' low nibbles (h 0) or high ones (h 1). */
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256 scale[2], offset[2];
    for (int64_t kk = k0; kk < k1; kk++) {
        if (kk == k0 || kk % GROUP == 0) {  /* the group's (scale, zero) pairs as words */
            const uint16_t *sz = lin->scale_zero + ((kk / GROUP) * N + col0) * 2;
            for (int v = 0; v < 2; v++) {
                __m256i pair = _mm256_loadu_si256((const __m256i *)(sz + 16 * v));
                __m256 zero;
                bf16_halves8(pair, &scale[v], &zero);
                offset[v] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale[v], zero);
            }
        }
        for (int v = 0; v < 2; v++) {
            __m256i bytes = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i *)(w + kk * PANEL_COLS + 8 * v)));
            bytes = h ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, low4);
            __m256 value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bytes), scale[v], offset[v]);
            _mm256_storeu_ps(panel + (kk - k0) * PANEL_COLS + 8 * v, value);
        }
    }
#endif
}

/* A panel's sums [M, cols] rounded to bf16 into y's columns col0.. (rows ldy apart;
 * + bias, rounded again, as q4_store does). */
static void panel_store(const stack_linear *lin, const float *sums, int M, int cols,
                        int64_t col0, uint16_t *y, int64_t ldy) {
    for (int t = 0; t < M; t++)
        for (int c = 0; c < cols; c += 16) {
            v16f sum;
            memcpy(&sum, sums + t * cols + c, sizeof sum);
            uint16_t *out = y + t * ldy + col0 + c;
            store16_bf16(out, sum);
            if (lin->bias != NULL)
                store16_bf16(out, load16_bf16(out) + load16_bf16(lin->bias + col0 + c));
        }
}

/* Panels [first, last) (panel p: half p % 2 of block p / 2) for M rows of x (float32
 * xf), rounded to bf16 into y (rows ldy apart; + bias, rounded again, as q4_store
 * does). scratch: (PANEL_CHUNK + M) * PANEL_COLS floats. */
static void q4_panels(const stack_linear *lin, const float *xf, int M, int64_t first,
                      int64_t last, float *scratch, uint16_t *y, int64_t ldy) {
    const int64_t K = lin->k;
    float *panel = scratch, *sums = scratch + PANEL_CHUNK * PANEL_COLS;
    for (int64_t p = first; p < last; p++) {
        for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
            const int64_t k1 = k0 + PANEL_CHUNK < K ? k0 + PANEL_CHUNK : K;
            q4_panel(lin, p / 2, (int)(p % 2), k0, k1, panel);
            panel_rows(xf, K, M, panel, k0, k1, sums);
        }
        panel_store(lin, sums, M, PANEL_COLS, p * PANEL_COLS, y, ldy);
    }
}

/* q4_panels over the threads, each an even share of the panels, PANEL_ROW_BLOCK rows
 * of x at a time (their float32 copy stays in L2 while every panel reads it); -1 out
 * of memory. */
static int q4_matmul_panels(int num_threads, const stack_linear *lin, const float *xf, int M,
                            uint16_t *y) {
    const int64_t panels = lin->n / PANEL_COLS;
    const int block = M < PANEL_ROW_BLOCK ? M : PANEL_ROW_BLOCK;
    int shares = num_threads < panels ? num_threads : (int)panels, failed = 0;
    if (shares < 1) shares = 1;
    #pragma omp parallel for num_threads(shares) schedule(static, 1) reduction(|:failed)
    for (int s = 0; s < shares; s++) {
        float *scratch = malloc(sizeof(float) * PANEL_COLS * ((size_t)PANEL_CHUNK + block));
        if (scratch == NULL) {
            failed = 1;
            continue;
        }
        for (int r0 = 0; r0 < M; r0 += block)
            q4_panels(lin, xf + (int64_t)r0 * lin->k, M - r0 < block ? M - r0 : block,
                      panels * s / shares, panels * (s + 1) / shares, scratch,
                      y + (int64_t)r0 * lin->n, lin->n);
        free(scratch);
    }
    return failed ? -1 : 0;
}
#endif

#if defined(PANEL_INT8)
/* From 3 rows on AVX-512 VNNI (dequant.py's INT8_MIN_ROWS): at 1 row the tiles stream
 * the weight faster (0.12 against 0.14 ms for a layer's four products), at 2 they tie,
 * at 3 the int8 panels take 0.18 ms against 0.23 (Ice Lake Xeon, 2 threads). */
#if defined(AVX2_ONLY)
/* AVX2's float32 tiles are bound by their own instructions at one row (a layer's four
 * products 0.14 ms with the weight in the caches, where reading it from memory would
 * take 0.075): from 1 row x is rounded to int8, and 1-2 rows take q4_rows_int8 (0.08
 * ms at 1 row); from 3 the panels (0.51 against the tiles' 0.69 at 3 rows, the AMX
 * Xeon as an AVX2 machine). */
#define Q4_INT8_ROWS 1
#define Q4_ROWS_INT8_MAX 2
#else
#define Q4_INT8_ROWS 3
#endif
/* The weight streams from memory once a step, and a decode step's few rows leave too
 * little work per byte for the hardware prefetchers to hide it (the int4 products of
 * the built-in model's 30 layers at 21 rows: 21.9 ms, 17.0 with the weight in the
 * caches; AVX2 build; benchmarks/cpu/cold_weights.py). So the panels ask for what they read
 * next:
 *  - block b + 1's rows [k0, k1) while block b's second panel (its high nibbles, whose
 *    bytes the first panel brought in) reads the same rows;
 *  - the next panel's (scale, zero) pairs, a cache line per group of k (two on
 *    AVX-512), N * 4 bytes apart: K / 32 short runs no prefetcher follows.
 * 21.9 -> 20.7 ms there; the 32-stream workload 1.05x. */
static inline void prefetch_block_rows(const stack_linear *lin, int64_t block, int64_t k0,
                                       int64_t k1) {
    const char *rows = (const char *)lin->weight + block * lin->k * PANEL8_COLS;
    for (int64_t b = k0 * PANEL8_COLS; b < k1 * PANEL8_COLS; b += 64)
        __builtin_prefetch(rows + b, 0, 2);
}

static inline void prefetch_panel_scales(const stack_linear *lin, int64_t panel) {
    for (int64_t g = 0; g < lin->k / PANEL8_Q; g++) {
        const char *pairs =
            (const char *)(lin->scale_zero + (g * lin->n + panel * PANEL8_COLS) * 2);
        for (int b = 0; b < PANEL8_COLS * 4; b += 64) __builtin_prefetch(pairs + b, 0, 2);
    }
}

/* q4_panels with x rounded to int8 (panel_int8.h): M rows of x as codes, their steps
 * and code sums (xq_rows); panel: PANEL8_CHUNK * PANEL8_COLS bytes; sums: M *
 * PANEL8_COLS floats. */
static void q4_panels_int8(const stack_linear *lin, const int8_t *codes, const float *step,
                           const float *csum, int M, int64_t first, int64_t last,
                           uint8_t *panel, float *sums, uint16_t *y, int64_t ldy) {
    const int64_t K = lin->k, N = lin->n;
    for (int64_t p = first; p < last; p++) {
        const int64_t col0 = p * PANEL8_COLS;
        if (p + 1 < last) prefetch_panel_scales(lin, p + 1);
        for (int64_t k0 = 0; k0 < K; k0 += PANEL8_CHUNK) {
            const int64_t k1 = k0 + PANEL8_CHUNK < K ? k0 + PANEL8_CHUNK : K;
            if (p % 2 == 1 && p + 1 < last) prefetch_block_rows(lin, p / 2 + 1, k0, k1);
            q4_panel_u8(lin->weight + (p / 2) * K * PANEL8_COLS, (int)(p % 2), k0, k1, panel);
            panel8_rows(codes, step, csum, K, M, panel, lin->scale_zero + col0 * 2, N, k0, k1,
                        sums);
        }
        panel_store(lin, sums, M, PANEL8_COLS, col0, y, ldy);
    }
}

#if defined(AVX2_ONLY)
/* M (1-2) rows' products with blocks [first, last) of ATen's AVX2 pack (32 columns, k
 * rows of 16 bytes: columns 0-15 in the low nibbles, 16-31 in the high ones), x rounded
 * to int8 (codes, with each row's steps and code sums per group), straight from the
 * pack: no panel. Rows k, k + 2 (one per 128-bit lane) and k + 1, k + 3 are interleaved
 * byte by byte, so that VPMADDUBSW multiplies a column's codes at k and k + 1 (low
 * lane) and at k + 2 and k + 3 (high lane) with x's (codes_pairs) and adds each pair:
 * 128 products in 4 instructions, where the float32 tiles take 16 FMAs and the
 * nibbles' 16 conversions. A group's int32 sums are the panels' exact integers, scaled
 * by the same float32 operations in the same order (panel8_group, panel8_scale_row),
 * so a row's result is bit for bit what it gets among more rows. Two rows share
 * each quad's unpacking. y: the rows' outputs, N apart. */
static inline __m256i codes_pairs(const int8_t *quad) {
    int32_t four;
    memcpy(&four, quad, sizeof four);
    const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(four), pairs);
}

static inline __m256i two_rows(const uint8_t *rows, int64_t k) {
    return _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows + k * 16))),
        _mm_loadu_si128((const __m128i *)(rows + (k + 2) * 16)), 1);
}

/* m rows' (1 or 2, a constant where inlined) 32 sums of block `rows` (columns col0..
 * col0 + 31) into sums (rows 32 apart): each quad of k is unpacked once for both. */
static inline __attribute__((always_inline)) void q4_rows_block(
        const stack_linear *lin, const uint8_t *rows, int64_t col0, const int m,
        const int8_t *codes, const float *step, const float *csum, float *sums) {
    const int64_t K = lin->k, N = lin->n, groups = K / PANEL8_Q;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[2][4];  /* the running sums: registers at 1 row */
    for (int t = 0; t < m; t++)
        for (int v = 0; v < 4; v++) acc[t][v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot[2][4];
        for (int t = 0; t < m; t++)
            for (int v = 0; v < 4; v++) dot[t][v] = _mm256_setzero_si256();
        for (int64_t k = g * PANEL8_Q; k < (g + 1) * PANEL8_Q; k += 4) {
            /* a line per quad (64 bytes), Q4_PREFETCH ahead (never faults) */
            __builtin_prefetch((const void *)((uintptr_t)(rows + k * 16) + Q4_PREFETCH), 0, 3);
            const __m256i a = two_rows(rows, k), b = two_rows(rows, k + 1);
            const __m256i al = _mm256_and_si256(a, low4), bl = _mm256_and_si256(b, low4);
            const __m256i ah = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
            const __m256i bh = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
            const __m256i w[4] = {_mm256_unpacklo_epi8(al, bl), _mm256_unpackhi_epi8(al, bl),
                                  _mm256_unpacklo_epi8(ah, bh), _mm256_unpackhi_epi8(ah, bh)};
            for (int t = 0; t < m; t++) {
                const __m256i xp = codes_pairs(codes + t * K + k);
                for (int v = 0; v < 4; v++)
                    dot[t][v] = _mm256_add_epi16(dot[t][v], _mm256_maddubs_epi16(w[v], xp));
            }
        }
        for (int t = 0; t < m; t++) {
            const __m256 dv = _mm256_set1_ps(step[t * groups + g]);
            const __m256 csv = _mm256_set1_ps(csum[t * groups + g]);
            for (int v = 0; v < 4; v++) {  /* columns 8v .. 8v + 7 of the block */
                const __m256i dot32 = _mm256_add_epi32(
                    _mm256_cvtepi16_epi32(_mm256_castsi256_si128(dot[t][v])),
                    _mm256_cvtepi16_epi32(_mm256_extracti128_si256(dot[t][v], 1)));
                __m256 scale, zero;
                bf16_halves8(_mm256_loadu_si256((const __m256i *)(
                                 lin->scale_zero + (g * N + col0 + 8 * v) * 2)),
                             &scale, &zero);
                const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
                acc[t][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32), _mm256_mul_ps(scale, dv),
                                            _mm256_fmadd_ps(offset, csv, acc[t][v]));
            }
        }
    }
    for (int t = 0; t < m; t++)
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(sums + 32 * t + 8 * v, acc[t][v]);
}

/* The next block's (scale, zero) pairs: a 128-byte run per group of k, N * 4 bytes
 * apart (K / 32 short runs no prefetcher follows). */
static inline void prefetch_block_scales(const stack_linear *lin, int64_t col0) {
    for (int64_t g = 0; g < lin->k / PANEL8_Q; g++) {
        const char *pairs = (const char *)(lin->scale_zero + (g * lin->n + col0) * 2);
        __builtin_prefetch(pairs, 0, 2);
        __builtin_prefetch(pairs + 64, 0, 2);
    }
}

static void q4_rows_int8(const stack_linear *lin, const int8_t *codes, const float *step,
                         const float *csum, int M, int64_t first, int64_t last, uint16_t *y) {
    const int64_t K = lin->k;
    for (int64_t nb = first; nb < last; nb++) {
        if (nb + 1 < last) prefetch_block_scales(lin, (nb + 1) * 32);
        float sums[2 * 32] __attribute__((aligned(32)));
        const uint8_t *rows = lin->weight + nb * K * 16;
        if (M == 1) q4_rows_block(lin, rows, nb * 32, 1, codes, step, csum, sums);
        else q4_rows_block(lin, rows, nb * 32, 2, codes, step, csum, sums);
        panel_store(lin, sums, M, 32, nb * 32, y, lin->n);
    }
}
#endif

/* y = x times the int4 weight with x rounded to int8 (q4_matmul_panels' split over
 * threads and rows); scratch: M * K / 4 + 2 M * K / 32 floats for the codes, steps and
 * code sums. Each thread's panel and sums (20 KB; 10 on AVX2) are on its stack:
 * nothing to fail. */
static void q4_matmul_int8(int num_threads, const stack_linear *lin, const uint16_t *x, int M,
                           uint16_t *y, void *scratch) {
    const int64_t K = lin->k, groups = K / PANEL8_Q, panels = lin->n / PANEL8_COLS;
    int8_t *codes = scratch;
    float *step = (float *)(codes + (int64_t)M * K), *csum = step + (int64_t)M * groups;
    int shares = num_threads < panels ? num_threads : (int)panels;
    if (shares < 1) shares = 1;
    #pragma omp parallel num_threads(shares)
    {
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        const int s = omp_get_thread_num(), nt = omp_get_num_threads();
        xq_rows_share(x, K, M, K, codes, step, csum, s, nt);
        #pragma omp barrier
#if defined(AVX2_ONLY)
        if (M <= Q4_ROWS_INT8_MAX) {  /* straight from the pack, block by block */
            const int64_t blocks = lin->n / 32;
            q4_rows_int8(lin, codes, step, csum, M, blocks * s / nt, blocks * (s + 1) / nt, y);
        } else
#endif
        {
            uint8_t panel[PANEL8_CHUNK * PANEL8_COLS] __attribute__((aligned(64)));
            float sums[PANEL_ROW_BLOCK * PANEL8_COLS] __attribute__((aligned(64)));
            for (int r0 = 0; r0 < M; r0 += PANEL_ROW_BLOCK) {
                const int rows = M - r0 < PANEL_ROW_BLOCK ? M - r0 : PANEL_ROW_BLOCK;
                q4_panels_int8(lin, codes + (int64_t)r0 * K, step + r0 * groups,
                               csum + r0 * groups, rows, panels * s / nt, panels * (s + 1) / nt,
                               panel, sums, y + (int64_t)r0 * lin->n, lin->n);
            }
        }
    }
}
#endif

/* Whether the library rounds x to int8 for int4 products of many rows where asked
 * (PANEL_INT8: AVX-512 VNNI, or AVX2): the column block of
 * ATen's int4 pack its panels read (64 or 32), or 0. */
int panel_int8(void) {
#if defined(PANEL_INT8)
    return Q4_PANEL_BN;
#else
    return 0;
#endif
}

/* The fewest rows whose int4 products round x to int8 where asked (dequant.py reads
 * it, so the torch layers round as the stack does), or 0 where nothing does. */
int q4_int8_min_rows(void) {
#if defined(PANEL_INT8)
    return Q4_INT8_ROWS;
#else
    return 0;
#endif
}

/* Whether q4_matmul rounds x to int8 for a product of M rows (where asked). */
static int q4_int8_applies(int int8_x, int M, int BN) {
#if defined(PANEL_INT8)
    return int8_x && M >= Q4_INT8_ROWS && BN == Q4_PANEL_BN;
#else
    (void)int8_x, (void)M, (void)BN;
    return 0;
#endif
}

/* y [M, N] = x [M, K] (bf16) times the int4 weight, rounded to bf16 (+ bias). Each
 * thread takes an even share of the chunks, not of the blocks: 9 blocks split 9/9
 * chunks, not 5/4 blocks. */
static void q4_matmul(int num_threads, const stack_linear *lin, int BN, const uint16_t *x, int M,
                      uint16_t *y, float *xf, float *xsum, int int8_x) {
    const int64_t K = lin->k, N = lin->n, groups = K / GROUP;
#if defined(PANEL_INT8)
    if (q4_int8_applies(int8_x, M, BN)) {  /* xf: room for the codes (M * K / 4 floats +) */
        q4_matmul_int8(num_threads, lin, x, M, y, xf);
        return;
    }
#endif
    for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
#if defined(PANEL_GEMMS) && !defined(__AVX512BF16__)
    /* (not where the CPU has bf16 arithmetic: there quant_gemm takes these products, or
     * x is rounded, and a step the stack keeps, as before the panels were built there,
     * runs the tiles) */
    if (M >= Q4_PANEL_ROWS && BN == Q4_PANEL_BN && q4_matmul_panels(num_threads, lin, xf, M, y) == 0)
        return;  /* (out of memory for the panels: the tiles below need none) */
#endif
    for (int t = 0; t < M; t++)  /* the tiles' zero terms: sum_k x_k per group */
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int kk = 0; kk < GROUP; kk++) s += xf[t * K + g * GROUP + kk];
            xsum[t * groups + g] = s;
        }
    const int64_t chunks = N / BN * (BN / 32);
    int shares = num_threads < chunks ? num_threads : (int)chunks;
    if (shares < 1) shares = 1;
    #pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int s = 0; s < shares; s++)
        q4_chunks(lin, BN, M, xf, xsum, chunks * s / shares, chunks * (s + 1) / shares, y);
}

/* Exposed for tests: y [M, N] = x [M, K] times one int4 weight. */
int q4_linear_bf16(int num_threads, const stack_linear *lin, int block_n, const uint16_t *x,
                   int M, uint16_t *y, int int8_x) {
    if (lin->k <= 0 || lin->k % GROUP || lin->n % block_n || (block_n != 32 && block_n != 64)
            || M < 0)
        return -2;
    /* the int8 codes, steps and code sums, or the float32 copy of x and its group sums */
    const size_t floats = q4_int8_applies(int8_x, M, block_n)
        ? (size_t)M * lin->k / 4 + 2 * (size_t)M * (lin->k / GROUP)
        : (size_t)M * lin->k + (size_t)M * (lin->k / GROUP);
    float *xf = malloc(sizeof(float) * floats);
    if (xf == NULL) return -1;
    float *xsum = q4_int8_applies(int8_x, M, block_n) ? NULL : xf + (size_t)M * lin->k;
    q4_matmul(num_threads, lin, block_n, x, M, y, xf, xsum, int8_x);
    free(xf);
    return 0;
}

/* y [M, N] = x [M, K] times one projection of the stack: dense bf16 by gemm.c's
 * bf16_gemm (the per-op path's NativeLinear calls it too: the same sums); int4 of many
 * rows by gemm.c's quant_gemm where the per-op path's products take it too (its bf16
 * tiles over dequantised panels), else by this file's kernels. Returns 0, or gemm.c's
 * code where it does not run (-3: not built for bf16 arithmetic; -1: out of memory). */
static int stack_matmul(int num_threads, const stack_linear *lin, const stack_dims *d,
                        const uint16_t *x, int M, uint16_t *y, float *xf, float *xsum) {
    if (lin->format == LINEAR_BF16)
        return bf16_gemm(num_threads, x, M, lin->k, (const uint16_t *)lin->weight, lin->n,
                         lin->k, lin->bias_f32, y, lin->n);
    if (d->quant_gemm_rows > 0 && M >= d->quant_gemm_rows)
        return quant_gemm(num_threads, x, M, lin->k, lin->weight, lin->scale_zero, 4, lin->n,
                          lin->k, lin->bias_f32, y, lin->n);
    q4_matmul(num_threads, lin, d->block_n, x, M, y, xf, xsum, d->int8_x);
    return 0;
}

/* Every layer for M query rows: x [M, hidden] bf16, the residual stream, updated in
 * place to the last layer's output (before the final norm). Row i attends the first
 * seq_lens[i] tokens of the context in block-table row i, its own K/V included: a
 * decode per sequence, or several rows of one sequence with the same table and
 * growing lengths (a drafted decode's 1 + k tokens, a short prompt), causal among
 * them since every row's K/V is stored before any row attends. cos, sin: [M,
 * head_dim / 2] float32; slots: [M] int64; tables [M, table_stride] and seq_lens [M]
 * int32. Returns 0; -1: out of memory, or a shape the kernels do not take (the caller
 * checks shapes first); or gemm.c's code for a product it does not take. */
int stack_decode_layers(int num_threads, const stack_dims *d, const stack_layer *layers, int num_layers,
                     uint16_t *x, int M, const float *cos, const float *sin,
                     const int64_t *slots, const int32_t *tables, int table_stride,
                     const int32_t *seq_lens) {
    const int64_t hidden = d->hidden, qdim = (int64_t)d->num_heads * d->head_dim;
    const int64_t qkv_dim = qdim + 2 * (int64_t)d->kv_heads * d->head_dim;
    const int64_t inter = d->intermediate;
    int64_t widest = hidden > qdim ? hidden : qdim;
    if (2 * inter > widest) widest = 2 * inter;
    if (qkv_dim > widest) widest = qkv_dim;
    /* h, qkv, q, attn, o, gate_up, act (bf16) and the float copies of a matmul's input */
    size_t halves = (size_t)M * (hidden + qkv_dim + 2 * qdim + hidden + 2 * inter + inter);
    /* (a bf16 stack, block_n 0, has no int4 product to need them) */
    size_t floats = d->block_n ? (size_t)M * widest + (size_t)M * (widest / GROUP + 1) : 1;
    uint16_t *h = malloc(halves * sizeof(uint16_t));
    float *xf = malloc(floats * sizeof(float));
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)M);
    int rc = 0;
    if (h == NULL || xf == NULL || rows == NULL) { rc = -1; goto done; }
    uint16_t *qkv = h + (size_t)M * hidden, *q = qkv + (size_t)M * qkv_dim;
    uint16_t *attn = q + (size_t)M * qdim, *o = attn + (size_t)M * qdim;
    uint16_t *gate_up = o + (size_t)M * hidden, *act = gate_up + (size_t)M * 2 * inter;
    float *xsum = xf + (size_t)M * widest;
    for (int i = 0; i < M; i++) rows[i] = i;
    /* A layer's MLP output (in o) joins the residual stream in the next layer's input
     * norm, which adds it in the same pass over the rows and rounds the sum as the
     * per-op path does; after the last layer, on its own. A separate single-threaded
     * add cost ~0.5 % of a 512-row prompt step. */
    int mlp_pending = 0;
    for (int l = 0; l < num_layers && rc == 0; l++) {
        const stack_layer *L = &layers[l];
        rc = add_rms_norm_bf16(num_threads, x, mlp_pending ? o : NULL, L->input_norm, h,
                               mlp_pending ? x : NULL, M, (int)hidden, d->eps);
        if (rc != 0) break;
        rc = stack_matmul(num_threads, &L->qkv, d, h, M, qkv, xf, xsum);
        if (rc == 0)
            rc = rope_and_cache(num_threads, qkv, qkv_dim, q, L->kv_cache, cos, sin, slots,
                                M, d->num_cache_blocks, d->block_size, d->num_heads,
                                d->kv_heads, d->head_dim, DTYPE_BF16);
        if (rc == 0)
            rc = paged_decode(num_threads, q, qdim, attn, L->kv_cache, rows, tables,
                              table_stride, NULL, seq_lens, M, d->num_cache_blocks, d->block_size,
                              d->num_heads, d->kv_heads, d->head_dim, d->scale, NULL, 0.0f,
                              DTYPE_BF16);
        if (rc != 0) break;
        rc = stack_matmul(num_threads, &L->o, d, attn, M, o, xf, xsum);
        if (rc == 0)
            rc = add_rms_norm_bf16(num_threads, x, o, L->post_norm, h, x, M, (int)hidden, d->eps);
        if (rc != 0) break;
        rc = stack_matmul(num_threads, &L->gate_up, d, h, M, gate_up, xf, xsum);
        if (rc != 0) break;
        silu_and_mul_bf16(num_threads, gate_up, M, inter, act);
        rc = stack_matmul(num_threads, &L->down, d, act, M, o, xf, xsum);
        mlp_pending = 1;
    }
    if (rc == 0 && mlp_pending)
        for (int64_t i = 0; i < (int64_t)M * hidden; i++)
            x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(o[i]));
done:
    free(h);
    free(xf);
    free(rows);
    return rc;
}
