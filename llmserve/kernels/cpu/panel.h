/* Rows of x times a panel of float32 weights: the inner loop of the CPU GEMMs that
 * turn their weight into float32 a panel at a time (int8 codes in q8_rows.c, int4 in
 * decoder.c), for products of many rows with x not rounded to int8 where gemm.c's
 * quant_gemm does not take them: chiefly AVX-512 builds without AVX512-BF16, and AVX2
 * builds (PANEL_GEMMS; panel_gemms() tells Python).
 *
 * A panel is PANEL_COLS output columns of the weight (PANEL_VECS 16-lane vectors: 32
 * on AVX-512, 16 on AVX2) over a chunk of k of at most PANEL_CHUNK (128) values, stored
 * [k, PANEL_COLS]: the values of one k side by side; 16 KB (8 on AVX2), so it stays in
 * L1 while every group of rows reads it. A group of up to PANEL_GROUP rows of x
 * multiplies it as a GEMM's outer products: per k, one x value broadcast against the
 * panel's vectors, the group's sums in registers (AVX-512: 12 rows x 2 vectors = 24 of
 * its 32 registers; AVX2: 6 rows x 2 half-width registers = 12 of its 16, with the
 * weight's two and the broadcast). The weight is converted once for all the rows, where
 * the few-row kernels convert it again for each small tile of rows.
 */
#ifndef LLMSERVE_PANEL_H
#define LLMSERVE_PANEL_H

#include <stdint.h>
#include <string.h>
#include "kernels.h"

/* Built for every AVX-512 CPU and for AVX2 (Zen 2/3, Haswell to Broadwell). Where the
 * CPU has bf16 arithmetic (AMX, Zen 4) quant_gemm or the int8 panels (panel_int8.h,
 * which use this file's row blocks and stores) take the products; these float32
 * panels then serve only q8_rows where x is rounded (an LM head off the int8 panels'
 * grid, below quant_gemm's crossover), and decoder.c leaves its int4 use of them out
 * of those builds. */
#if defined(__AVX512F__)
#define PANEL_GEMMS 1
#define PANEL_VECS 2
#define PANEL_GROUP 12
#elif defined(AVX2_ONLY)
#define PANEL_GEMMS 1
#define PANEL_VECS 1
#define PANEL_GROUP 6
#endif

#if defined(PANEL_GEMMS)
#define PANEL_COLS (16 * PANEL_VECS)
#define PANEL_CHUNK 128
/* The registers of a panel's row inside the GEMM: two of the ISA's own width (16 lanes
 * or 8). kernels.h's 16-lane type would be two AVX2 registers, which GCC keeps on the
 * stack when they are 12 sums (10x slower). */
#if PANEL_VECS == 2
typedef v16f panel_vec;
#else
typedef float panel_vec __attribute__((vector_size(32)));
#endif
#define PANEL_LANES ((int)(sizeof(panel_vec) / sizeof(float)))
#define PANEL_REGS (PANEL_COLS / PANEL_LANES)
/* Rows of x a GEMM takes at a time: 96 rows of a 576-wide x are 221 KB of float32,
 * in L2 while each panel reads them; all 512 rows of a prefill chunk would spill to L3
 * (1.5x slower at 512 rows on an Ice Lake Xeon). */
#define PANEL_ROW_BLOCK 96

/* sums [m, PANEL_COLS] (+)= rows [0, m) of x (float32, rows ldx apart; m <= PANEL_GROUP)
 * times the panel over k in [k0, k1) (x's columns k0.., the panel's rows 0..): the sums
 * start from zero where k0 is 0, else from those of the chunks before. */
static inline __attribute__((always_inline)) void panel_group(
        const float *x, int64_t ldx, int m, const float *panel, int64_t k0, int64_t k1,
        float *sums) {
    panel_vec acc[PANEL_GROUP][PANEL_REGS];
    _Pragma("GCC unroll 12") for (int t = 0; t < m; t++)
        for (int v = 0; v < PANEL_REGS; v++) {
            acc[t][v] = (panel_vec){0};
            if (k0 > 0)
                memcpy(&acc[t][v], sums + t * PANEL_COLS + PANEL_LANES * v, sizeof acc[t][v]);
        }
    for (int64_t kk = k0; kk < k1; kk++) {
        panel_vec w[PANEL_REGS];
        for (int v = 0; v < PANEL_REGS; v++)
            memcpy(&w[v], panel + (kk - k0) * PANEL_COLS + PANEL_LANES * v, sizeof w[v]);
        _Pragma("GCC unroll 12") for (int t = 0; t < m; t++) {
            const float xv = x[t * ldx + kk];
            for (int v = 0; v < PANEL_REGS; v++) acc[t][v] += xv * w[v];
        }
    }
    _Pragma("GCC unroll 12") for (int t = 0; t < m; t++)
        for (int v = 0; v < PANEL_REGS; v++)
            memcpy(sums + t * PANEL_COLS + PANEL_LANES * v, &acc[t][v], sizeof acc[t][v]);
}

/* All m rows of x (any number), in groups of at most PANEL_GROUP rows as even as can
 * be (21 rows on AVX2: 6, 5, 5, 5, not 6, 6, 6, 3; 13: 5, 4, 4, not 6, 6, 1), each
 * with its size known to the compiler; sums [m, PANEL_COLS]. A group of few rows has
 * too few sums in flight to hide the FMA's latency (4 cycles, 2 a cycle: 8 wanted). */
static inline void panel_rows(const float *x, int64_t ldx, int64_t m, const float *panel,
                              int64_t k0, int64_t k1, float *sums) {
#define PANEL_CASE(M_) case M_: panel_group(xs, ldx, M_, panel, k0, k1, s); break;
    const int64_t groups = (m + PANEL_GROUP - 1) / PANEL_GROUP;
    for (int64_t g = 0, t0 = 0; g < groups; g++) {
        const int rows = (int)(m / groups + (g < m % groups));
        const float *xs = x + t0 * ldx;
        float *s = sums + t0 * PANEL_COLS;
        switch (rows) {
            PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5)
            PANEL_CASE(6)
#if PANEL_GROUP == 12
            PANEL_CASE(7) PANEL_CASE(8) PANEL_CASE(9) PANEL_CASE(10) PANEL_CASE(11)
            PANEL_CASE(12)
#endif
        }
        t0 += rows;
    }
#undef PANEL_CASE
}
#endif

#endif
