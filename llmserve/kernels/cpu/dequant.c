/* An int4 weight dequantised to float32, for CPUs without bf16 arithmetic.
 *
 * Where the CPU has neither AVX512-BF16 nor AMX, quant_gemm's bf16 tiles (gemm.c) do
 * not run, and ATen's weight-only int4 kernel dequantises every weight again for each
 * small tile of rows: at 512 rows it is 2.3x slower than the float32 GEMM of the same
 * weight (Ice Lake Xeon, AVX-512 without BF16). A product of many rows there is cheaper
 * as one pass that writes the weight out in float32 (~0.4 ms for the built-in model's
 * gate_up) and the float32 GEMM over it: dequant.py's quant_dense_f32, from
 * DEQUANT_MIN_ROWS (384; fewer rows take decoder.c's panel GEMM).
 *
 * Reads ATen's CPU int4 pack as decoder.c does (blocks of BN output columns,
 * [N / BN, K, BN / 2] bytes, byte j of row k holding column j in its low nibble and
 * column j + BN / 2 in its high one; a [K / 32, N, 2] bf16 (scale, zero) table) and
 * writes W^T, [K, N] float32: each row k is contiguous over the output columns, so both
 * the nibbles and the scales are read and written in order, and the GEMM takes it as
 * its (transposed) B operand. w = q scale + (zero - 8 scale), as quant_gemm computes it.
 *
 * Plain C: the compiler vectorises the inner loop for the build's ISA (AVX-512, AVX2 or
 * the baseline). */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define GROUP 32 /* int4 group size along K (quantization.INT4_GROUP) */

/* Rows [g * GROUP, (g + 1) * GROUP) of W^T's columns [c0, c1), with the group's scales
 * and offsets first turned into float32 (scratch: 2 (c1 - c0) floats). */
static void dequant_group(const stack_linear *lin, int block_n, int64_t g, int64_t c0,
                          int64_t c1, float *scratch, float *out) {
    const int64_t n = lin->n, k = lin->k, half = block_n / 2, width = c1 - c0;
    const uint16_t *sz = (const uint16_t *)lin->scale_zero + (g * n + c0) * 2;
    float *scale = scratch, *offset = scratch + width;
    for (int64_t c = 0; c < width; c++) {
        scale[c] = bf16_to_f32(sz[2 * c]);
        offset[c] = bf16_to_f32(sz[2 * c + 1]) - 8.0f * scale[c];
    }
    const uint8_t *q = (const uint8_t *)lin->weight;
    for (int64_t r = g * GROUP; r < (g + 1) * GROUP; r++) {
        float *row = out + r * width;
        for (int64_t b = c0 / block_n; b < c1 / block_n; b++) {
            const uint8_t *src = q + (b * k + r) * half;
            const int64_t o = b * block_n - c0;
            for (int64_t j = 0; j < half; j++) {
                row[o + j] = (float)(src[j] & 15) * scale[o + j] + offset[o + j];
                row[o + half + j] = (float)(src[j] >> 4) * scale[o + half + j]
                                    + offset[o + half + j];
            }
        }
    }
}

/* out [k, c1 - c0] float32 = columns [c0, c1) of W^T, for the int4 linear lin packed
 * by ATen in blocks of block_n (64 or 32) columns; c0 and c1 on that grid. Returns -2
 * for a shape or range off the grid, -1 when out of memory for the scratch, 0 when
 * done. */
int q4_dequant_f32(int num_threads, const stack_linear *lin, int block_n, int64_t c0,
                   int64_t c1, float *out) {
    if ((block_n != 64 && block_n != 32) || lin->n % block_n || lin->k % GROUP
            || c0 % block_n || c1 % block_n || c0 < 0 || c1 > lin->n || c0 >= c1)
        return -2;
    const int64_t groups = lin->k / GROUP;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads > 1 ? num_threads : 1) reduction(|:failed)
    {
        float *scratch = malloc(2 * (c1 - c0) * sizeof(float));
        if (scratch == NULL) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++)
            if (scratch != NULL) dequant_group(lin, block_n, g, c0, c1, scratch, out);
        free(scratch);
    }
    return failed ? -1 : 0;
}
