/* One projection's multi-LoRA in one call: for each group of rows under one adapter,
 * xa = x_rows @ A^T (float32 sums), then y_rows += xa @ B^T slice by slice, rounded
 * once into y's dtype.
 *
 * Why C: at decode sizes (a few rows per adapter, rank 8) the arithmetic is a few
 * microseconds; the torch path spends most of its time in the fixed cost of its ~6
 * small ops per projection (conversions, two bmm, rounding, the add). Here the rows
 * are read and written in place, the x tile is converted once, and the expand skips
 * the block-diagonal zeros (slice i of y only uses xa's columns i*r : (i+1)*r).
 *
 * Weights (lora.py's gather_weights): A [G, n*r, K] (slice i's A in rows i*r ...),
 * and B transposed over the slices, Bt [G, r, N] (column c of slice i holds that
 * slice's B[c - start_i, :] down its r rows), in float32 or bfloat16 (weights stored
 * in bf16 are exact in bf16, and half the bytes to read). Groups are CSR: group g's
 * rows are rows[starts[g] : starts[g + 1]] (row indices of both x and y).
 * Plain float32 FMA code (GCC vector types): right on AVX2, AVX-512 and AMX machines.
 * Built with the other kernels into one library by native.py (declared in kernels.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

#define TILE 4  /* rows sharing one read of a weight vector */

static inline v16f load16_f32(const float *src) {
    v16f out;
    memcpy(&out, src, sizeof out);
    return out;
}

static inline void store16_f32(float *dst, v16f x) { memcpy(dst, &x, sizeof x); }

static inline __attribute__((always_inline)) v16f load16(const void *base, int64_t i,
                                                         const int bf16) {
    return bf16 ? load16_bf16((const uint16_t *)base + i) : load16_f32((const float *)base + i);
}

static inline __attribute__((always_inline)) float load1(const void *base, int64_t i,
                                                         const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline float sum16(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* A rows sharing one read of each x vector: TILE * JB accumulators fill AVX-512's 32
 * registers, half of them on AVX2's 16 (two registers a v16f). */
#if defined(__AVX512F__)
#define JB 4
#else
#define JB 2
#endif

/* xa[t][j] = x_row_t . A[j] for the tile's m rows (xf: those rows in float32). */
static inline __attribute__((always_inline)) void shrink(
        const float *xf, int m, int64_t K, const void *a, int nr, const int w_bf16,
        float *xa) {
    const int64_t K16 = K / 16 * 16;
    int j = 0;
    for (; j + JB <= nr; j += JB) {
        v16f acc[TILE][JB];
        for (int t = 0; t < m; t++)
            for (int u = 0; u < JB; u++) acc[t][u] = (v16f){0};
        const int64_t row0 = (int64_t)j * K;
        for (int64_t k = 0; k < K16; k += 16) {
            v16f av[JB];
            for (int u = 0; u < JB; u++) av[u] = load16(a, row0 + u * K + k, w_bf16);
            for (int t = 0; t < m; t++) {
                v16f xv = load16_f32(xf + t * K + k);
                for (int u = 0; u < JB; u++) acc[t][u] += xv * av[u];
            }
        }
        for (int t = 0; t < m; t++)
            for (int u = 0; u < JB; u++) {
                float s = sum16(acc[t][u]);
                for (int64_t k = K16; k < K; k++)
                    s += xf[t * K + k] * load1(a, row0 + u * K + k, w_bf16);
                xa[t * nr + j + u] = s;
            }
    }
    for (; j < nr; j++) {
        for (int t = 0; t < m; t++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += xf[t * K + k] * load1(a, (int64_t)j * K + k, w_bf16);
            xa[t * nr + j] = s;
        }
    }
}

/* y_rows[:, c0:c1] += xa[:, col0:col0 + r] @ Bt[:, c0:c1], rounded once into y. */
static inline __attribute__((always_inline)) void expand(
        void *const *yrows, int m, const float *xa, int nr, int col0, const void *bt, int r,
        int64_t N, int64_t c0, int64_t c1, const int io_bf16, const int w_bf16) {
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        v16f acc[TILE];
        for (int t = 0; t < m; t++) acc[t] = load16(yrows[t], c, io_bf16);
        for (int k = 0; k < r; k++) {
            v16f b = load16(bt, (int64_t)k * N + c, w_bf16);
            for (int t = 0; t < m; t++) acc[t] += xa[t * nr + col0 + k] * b;
        }
        for (int t = 0; t < m; t++) {
            if (io_bf16) store16_bf16((uint16_t *)yrows[t] + c, acc[t]);
            else store16_f32((float *)yrows[t] + c, acc[t]);
        }
    }
    for (; c < c1; c++) {
        for (int t = 0; t < m; t++) {
            float s = load1(yrows[t], c, io_bf16);
            for (int k = 0; k < r; k++) s += xa[t * nr + col0 + k] * load1(bt, (int64_t)k * N + c, w_bf16);
            if (io_bf16) ((uint16_t *)yrows[t])[c] = f32_to_bf16(s);
            else ((float *)yrows[t])[c] = s;
        }
    }
}

/* One tile: up to TILE rows of one group, shrink then expand of every slice. */
static inline __attribute__((always_inline)) void lora_tile(
        const void *x, int64_t ldx, void *y, int64_t ldy, const int64_t *rows, int m,
        const void *a, const void *bt, int n, int r, int64_t K, int64_t N,
        const int64_t *slice_ends, float *xf, float *xa, const int io_bf16, const int w_bf16) {
    const int nr = n * r;
    void *yrows[TILE];
    for (int t = 0; t < m; t++) {
        const int64_t row = rows[t];
        for (int64_t k = 0; k < K; k++) xf[t * K + k] = load1(x, row * ldx + k, io_bf16);
        yrows[t] = io_bf16 ? (void *)((uint16_t *)y + row * ldy) : (void *)((float *)y + row * ldy);
    }
    shrink(xf, m, K, a, nr, w_bf16, xa);
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
        expand(yrows, m, xa, nr, i * r, bt, r, N, start, slice_ends[i], io_bf16, w_bf16);
        start = slice_ends[i];
    }
}

/* y[rows of group g] += (x[those rows] @ A_g^T) @ B_g^T for every group, in place.
 * x [num_rows, x_cols] and y [num_rows, y_cols] (rows ldx and ldy apart), of dtype
 * (DTYPE_F32 / DTYPE_BF16); w_dtype: A's and Bt's. slice_ends [n]: each slice's last
 * column + 1. Returns 0; -1 on arguments that do not fit (a row out of range, x_cols
 * not k, y_cols not the last slice end, an unknown dtype), y untouched; -2 out of
 * memory. */
int lora_add_rows(int num_threads, const void *x, int64_t ldx, int64_t x_cols, void *y,
                  int64_t ldy, int64_t y_cols, int64_t num_rows, int dtype, const int64_t *rows,
                  const int32_t *starts, int num_groups, const void *a, const void *bt,
                  int w_dtype, int n, int r, int64_t k, const int64_t *slice_ends) {
    if (num_groups <= 0 || n <= 0 || r <= 0 || k <= 0 || x_cols != k
            || slice_ends[n - 1] != y_cols || starts[0] != 0
            || (dtype != DTYPE_F32 && dtype != DTYPE_BF16)
            || (w_dtype != DTYPE_F32 && w_dtype != DTYPE_BF16))
        return -1;
    for (int g = 0; g < num_groups; g++)
        if (starts[g + 1] < starts[g]) return -1;
    for (int32_t i = 0; i < starts[num_groups]; i++)
        if (rows[i] < 0 || rows[i] >= num_rows) return -1;
    for (int i = 0; i < n; i++)
        if (slice_ends[i] < (i ? slice_ends[i - 1] : 0)) return -1;
    const int64_t N = slice_ends[n - 1];
    /* Work items: tiles of up to TILE rows of one group. */
    int num_tiles = 0;
    for (int g = 0; g < num_groups; g++) num_tiles += (starts[g + 1] - starts[g] + TILE - 1) / TILE;
    int32_t *tile_group = malloc((size_t)num_tiles * 2 * sizeof(int32_t) + 1);
    if (tile_group == NULL) return -2;
    int32_t *tile_first = tile_group + num_tiles;
    for (int g = 0, i = 0; g < num_groups; g++)
        for (int32_t first = starts[g]; first < starts[g + 1]; first += TILE, i++) {
            tile_group[i] = g;
            tile_first[i] = first;
        }
    const int io_bf16 = dtype == DTYPE_BF16, w_bf16 = w_dtype == DTYPE_BF16;
    const int64_t a_size = (int64_t)n * r * k, bt_size = (int64_t)r * N;
    const size_t w_bytes = w_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed) if(num_tiles > 1)
    {
        float *xf = malloc(((size_t)TILE * k + (size_t)TILE * n * r) * sizeof(float));
        failed = xf == NULL;
        #pragma omp for schedule(static)
        for (int i = 0; i < num_tiles; i++) {
            if (xf == NULL) continue;
            const int g = tile_group[i], first = tile_first[i];
            const int m = starts[g + 1] - first < TILE ? starts[g + 1] - first : TILE;
            const void *ag = (const char *)a + (size_t)g * a_size * w_bytes;
            const void *btg = (const char *)bt + (size_t)g * bt_size * w_bytes;
            float *xa = xf + (size_t)TILE * k;
            /* Constant dtypes: the compiler specialises each case's loops. */
            if (io_bf16 && w_bf16)
                lora_tile(x, ldx, y, ldy, rows + first, m, ag, btg, n, r, k, N, slice_ends, xf, xa, 1, 1);
            else if (io_bf16)
                lora_tile(x, ldx, y, ldy, rows + first, m, ag, btg, n, r, k, N, slice_ends, xf, xa, 1, 0);
            else if (w_bf16)
                lora_tile(x, ldx, y, ldy, rows + first, m, ag, btg, n, r, k, N, slice_ends, xf, xa, 0, 1);
            else
                lora_tile(x, ldx, y, ldy, rows + first, m, ag, btg, n, r, k, N, slice_ends, xf, xa, 0, 0);
        }
        free(xf);
    }
    free(tile_group);
    return failed ? -2 : 0;
}
