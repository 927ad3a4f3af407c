/* The whole decoder stack of an int4 model for one decode step, in one call.
 *
 * A decode step of a small model on a CPU spends as long in Python between ops
 * (~25 a layer) as in the ops themselves. Here every layer runs in C: RMSNorm, the
 * int4 projections (read straight from ATen's packed weights, so there is one copy),
 * rotary + the K/V store, paged attention, SiLU-and-multiply and the residual adds,
 * rounded to bfloat16 at the same points as the torch path.
 *
 * Weights are ATen's CPU int4 pack (``_convert_weight_to_int4pack_for_cpu``): blocks
 * of BN output columns, [N / BN, K, BN / 2] bytes, byte j of row k holding column j in
 * its low nibble and column j + BN / 2 in its high one (BN 64 where ATen is built for
 * AVX-512, 32 for AVX2; decoder.py checks which at start-up), with a [K / 32, N, 2]
 * bfloat16 (scale, zero) table: w = (q - 8) * scale + zero.
 * Built with decode.c and gemm.c into one library by native.py; the structures it
 * reads (q4_linear, q4_layer, q4_dims) are declared in kernels.h.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "kernels.h"

#define GROUP 32  /* int4 group size along K (quantization.INT4_GROUP) */
#define TILE 4    /* tokens sharing one read of a weight block */

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

/* One block of BN columns (BN / 16 vectors) for m <= TILE tokens: per group, the
 * dot products with the integer codes, then scale and zero, since
 * sum_k x_k ((q_k - 8) s + z) = s sum_k x_k q_k + (z - 8 s) sum_k x_k. */
static inline __attribute__((always_inline)) void q4_block(
        const float *xf, const float *xsum, const int m, int64_t K, int64_t N, const int BN,
        const uint8_t *w, const uint16_t *sz, int64_t col0, v16f acc[TILE][4]) {
    const int V = BN / 16, half = BN / 2, groups = (int)(K / GROUP);
    for (int t = 0; t < m; t++)
        for (int v = 0; v < V; v++) acc[t][v] = (v16f){0};
    for (int g = 0; g < groups; g++) {
        v16f part[TILE][4];
        for (int t = 0; t < m; t++)
            for (int v = 0; v < V; v++) part[t][v] = (v16f){0};
        const uint8_t *b = w + (int64_t)g * GROUP * half;
        for (int kk = 0; kk < GROUP; kk++, b += half) {
            /* low nibbles: the block's first half of columns; high: the second */
            v16f col[4];
            for (int v = 0; v < V / 2; v++) {
                v16i bytes = widen16(b + 16 * v);
                col[v] = __builtin_convertvector(bytes & 15, v16f);
                col[v + V / 2] = __builtin_convertvector(bytes >> 4, v16f);
            }
            for (int t = 0; t < m; t++) {
                const float xv = xf[t * K + g * GROUP + kk];
                for (int v = 0; v < V; v++) part[t][v] += xv * col[v];
            }
        }
        /* (scale, zero) bf16 pairs as one 32-bit word each: bf16 is float's top half */
        const uint16_t *szg = sz + ((int64_t)g * N + col0) * 2;
        for (int v = 0; v < V; v++) {
            v16u32 pair;
            memcpy(&pair, szg + 32 * v, sizeof pair);  /* bf16 storage, read as words */
            v16f scale = (v16f)(pair << 16), zero = (v16f)(pair & 0xFFFF0000u);
            v16f offset = zero - 8.0f * scale;
            for (int t = 0; t < m; t++)
                acc[t][v] += scale * part[t][v] + offset * xsum[t * groups + g];
        }
    }
}

/* The block for a tile of tokens, with the tile's size and BN known to the compiler. */
static void q4_tile(const float *xf, const float *xsum, int m, int64_t K, int64_t N, int BN,
                    const uint8_t *w, const uint16_t *sz, int64_t col0, v16f acc[TILE][4]) {
#define Q4_CASE(M_)                                                             \
    case M_:                                                                    \
        if (BN == 64) q4_block(xf, xsum, M_, K, N, 64, w, sz, col0, acc);       \
        else q4_block(xf, xsum, M_, K, N, 32, w, sz, col0, acc);                \
        break;
    switch (m) { Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) }
#undef Q4_CASE
}

/* y [M, N] = x [M, K] (bf16) times the int4 weight, rounded to bf16 (then + bias,
 * rounded again, as the torch path adds it). */
static void q4_matmul(int num_threads, const q4_linear *lin, int BN, const uint16_t *x, int M,
                      uint16_t *y, float *xf, float *xsum) {
    const int64_t K = lin->k, N = lin->n, groups = K / GROUP;
    for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
    for (int t = 0; t < M; t++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int kk = 0; kk < GROUP; kk++) s += xf[t * K + g * GROUP + kk];
            xsum[t * groups + g] = s;
        }
    const int64_t blocks = N / BN;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        v16f acc[TILE][4];
        const uint8_t *w = lin->weight + nb * K * (BN / 2);
        for (int t0 = 0; t0 < M; t0 += TILE) {
            const int m = M - t0 < TILE ? M - t0 : TILE;
            q4_tile(xf + t0 * K, xsum + t0 * groups, m, K, N, BN, w, lin->scale_zero,
                    nb * BN, acc);
            for (int t = 0; t < m; t++)
                for (int j = 0; j < BN; j++) {
                    const int64_t col = nb * BN + j;
                    uint16_t v = f32_to_bf16(acc[t][j / 16][j % 16]);
                    if (lin->bias != NULL) v = f32_to_bf16(bf16_to_f32(v) + bf16_to_f32(lin->bias[col]));
                    y[(t0 + t) * N + col] = v;
                }
        }
    }
}

/* Exposed for tests: y [M, N] = x [M, K] times one int4 weight. */
int q4_linear_bf16(int num_threads, const q4_linear *lin, int block_n, const uint16_t *x,
                   int M, uint16_t *y) {
    if (lin->k % GROUP || lin->n % block_n || (block_n != 32 && block_n != 64)) return -2;
    float *xf = malloc(sizeof(float) * ((size_t)M * lin->k + (size_t)M * (lin->k / GROUP)));
    if (xf == NULL) return -1;
    q4_matmul(num_threads, lin, block_n, x, M, y, xf, xf + (size_t)M * lin->k);
    free(xf);
    return 0;
}

/* Every layer for M query rows: x [M, hidden] bf16, the residual stream, updated in
 * place to the last layer's output (before the final norm). Row i attends the first
 * seq_lens[i] tokens of the context in block-table row i, its own K/V included: a
 * decode per sequence, or several rows of one sequence with the same table and
 * growing lengths (a drafted decode's 1 + k tokens, a short prompt), causal among
 * them since every row's K/V is stored before any row attends. cos, sin: [M,
 * head_dim / 2] float32; slots: [M] int64; tables [M, table_stride] and seq_lens [M]
 * int32. Returns 0, or -1: out of memory, or
 * a shape the kernels do not take (the caller checks shapes first). */
int q4_decode_layers(int num_threads, const q4_dims *d, const q4_layer *layers, int num_layers,
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
    size_t floats = (size_t)M * widest + (size_t)M * (widest / GROUP + 1);
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
    for (int l = 0; l < num_layers && rc == 0; l++) {
        const q4_layer *L = &layers[l];
        rc = add_rms_norm_bf16(num_threads, x, NULL, L->input_norm, h, NULL, M, (int)hidden,
                               d->eps);
        if (rc != 0) break;
        q4_matmul(num_threads, &L->qkv, d->block_n, h, M, qkv, xf, xsum);
        rc = rope_and_cache(num_threads, qkv, qkv_dim, q, L->kv_cache, cos, sin, slots, M,
                            d->num_cache_blocks, d->block_size, d->num_heads, d->kv_heads,
                            d->head_dim, DTYPE_BF16);
        if (rc == 0)
            rc = paged_decode(num_threads, q, qdim, attn, L->kv_cache, rows, tables,
                              table_stride, NULL, seq_lens, M, d->num_cache_blocks, d->block_size,
                              d->num_heads, d->kv_heads, d->head_dim, d->scale, NULL, 0.0f,
                              DTYPE_BF16);
        if (rc != 0) break;
        q4_matmul(num_threads, &L->o, d->block_n, attn, M, o, xf, xsum);
        rc = add_rms_norm_bf16(num_threads, x, o, L->post_norm, h, x, M, (int)hidden, d->eps);
        if (rc != 0) break;
        q4_matmul(num_threads, &L->gate_up, d->block_n, h, M, gate_up, xf, xsum);
        silu_and_mul_bf16(num_threads, gate_up, M, inter, act);
        q4_matmul(num_threads, &L->down, d->block_n, act, M, o, xf, xsum);
        for (int64_t i = 0; i < (int64_t)M * hidden; i++)
            x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(o[i]));
    }
done:
    free(h);
    free(xf);
    free(rows);
    return rc;
}
