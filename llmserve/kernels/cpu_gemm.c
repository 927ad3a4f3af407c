/* bf16 linears, y [M, N] = x [M, K] W^T (+ bias), on CPUs with AVX512-BF16 and no AMX.
 *
 * oneDNN reaches ~89 % of this machine's bf16 peak at 256 rows but 63 % at 32, the
 * decode range, and stalls on reading the weights below 16 rows (~18 GB/s where this
 * kernel streams ~30). This kernel is the classic register-tiled one for VDPBF16PS:
 *
 * - the weight is packed once into panels of 16 output columns, each K/2 rows of 16
 *   column pairs [k, k+1]: one 64-byte load feeds one VDPBF16PS, and a panel is read
 *   front to back (what the hardware prefetcher follows best);
 * - a tile of up to TILE_ROWS rows x TILE_PANELS panels keeps its float32 sums in
 *   registers (6 x 4 = 24 of AVX-512's 32); each k pair loads the tile's panels once
 *   and broadcasts each row's pair from memory;
 * - threads split the panels (16-column units, so 576 columns split evenly over two
 *   threads where 64-column blocks would not); within a thread, all row tiles of a
 *   chunk of rows pass over the same panels while they sit in L2, so that the weights
 *   come from memory once per chunk.
 *
 * Sums in float32, rounded to bf16 once at the end (round to nearest even), as oneDNN
 * does: results match oneDNN's to bf16 rounding of differently ordered float32 sums.
 * Built and loaded by cpu_native.py; elsewhere than AVX512-BF16 it builds as a stub
 * that says so (bf16_gemm_available). */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

enum {
    PANEL_COLS = 16,   /* output columns of one panel: one register of float32 sums */
    TILE_ROWS = 6,     /* 6 rows x 4 panels = 24 accumulators, 4 registers of weights */
    TILE_PANELS = 4,
    CHUNK_ROWS = 112,  /* rows whose tiles reuse a group of panels from L2 */
    LINE = 64,         /* bytes of a cache line */
};

int bf16_gemm_available(void) { return 1; }

/* One bf16 pair of a row as a 32-bit lane (unaligned, may alias the bf16 array). */
typedef int32_t pair_bits __attribute__((may_alias, aligned(2)));

/* rows x panels outputs over all of K: sums in registers, one pass over the panels.
 * Both counts are compile-time constants at each call site (see tile_dispatch), so the
 * loops unroll and acc stays in registers. Each k pair also prefetches one line at
 * prefetch + k * prefetch_step into L2 (a step of 0 keeps touching the same line). */
static inline __attribute__((always_inline)) void tile(
        int rows, int panels, const uint16_t *x, int64_t ldx, const uint16_t *w,
        int64_t panel_stride, int64_t pairs, const float *bias, uint16_t *y, int64_t ldy,
        const char *prefetch, int64_t prefetch_step) {
    __m512 acc[TILE_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; k++) {
        __m512bh wk[TILE_PANELS];
        _mm_prefetch(prefetch + k * prefetch_step, _MM_HINT_T1);
        for (int p = 0; p < panels; p++)
            wk[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_stride + k * 2 * PANEL_COLS);
        for (int r = 0; r < rows; r++) {
            __m512bh xk = (__m512bh)_mm512_set1_epi32(*(const pair_bits *)(x + r * ldx + 2 * k));
            for (int p = 0; p < panels; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xk, wk[p]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) {
            __m512 sum = acc[r][p];
            if (bias != NULL) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + p * PANEL_COLS));
            _mm256_storeu_si256((__m256i *)(y + r * ldy + p * PANEL_COLS),
                                (__m256i)_mm512_cvtneps_pbh(sum));
        }
}

#define TILE_CASE(R, P) \
    tile(R, P, x, ldx, w, panel_stride, pairs, bias, y, ldy, prefetch, prefetch_step)
#define TILE_ROW_CASE(R)                                   \
    case R:                                                \
        switch (panels) {                                  \
            case 1: TILE_CASE(R, 1); break;                \
            case 2: TILE_CASE(R, 2); break;                \
            case 3: TILE_CASE(R, 3); break;                \
            default: TILE_CASE(R, 4); break;               \
        }                                                  \
        break;

static void tile_dispatch(int rows, int panels, const uint16_t *x, int64_t ldx,
                          const uint16_t *w, int64_t panel_stride, int64_t pairs,
                          const float *bias, uint16_t *y, int64_t ldy,
                          const char *prefetch, int64_t prefetch_step) {
    switch (rows) {
        TILE_ROW_CASE(1) TILE_ROW_CASE(2) TILE_ROW_CASE(3) TILE_ROW_CASE(4)
        TILE_ROW_CASE(5) default: TILE_ROW_CASE(6)
    }
}

/* One thread's panels [first, last) for rows [0, m) of x. Rows go in chunks; within a
 * chunk, every tile of rows passes over the same group of TILE_PANELS panels (from L2
 * after the first tile) before the next group. Meanwhile the tiles prefetch the next
 * group into L2, a line per k pair, so that its weights stream from memory under this
 * group's arithmetic instead of stalling the next group's first tile: 1.14x at 32 rows.
 * Tiles of a chunk are balanced (32 rows: 6, 5, 5, 6, 5, 5; never 6 x 5 and a lone 2). */
static void gemm_panels(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *packed,
                        int64_t k, const float *bias, uint16_t *y, int64_t ldy, int64_t first,
                        int64_t last) {
    const int64_t pairs = k / 2, panel_stride = pairs * 2 * PANEL_COLS;
    for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
        int64_t rows = m - m0 < CHUNK_ROWS ? m - m0 : CHUNK_ROWS;
        int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
        for (int64_t p0 = first; p0 < last; p0 += TILE_PANELS) {
            int panels = last - p0 < TILE_PANELS ? (int)(last - p0) : TILE_PANELS;
            const uint16_t *w = packed + p0 * panel_stride;
            const float *b = bias == NULL ? NULL : bias + p0 * PANEL_COLS;
            int64_t next = p0 + panels, next_panels = last - next;
            if (next_panels > TILE_PANELS) next_panels = TILE_PANELS;
            const char *ahead = (const char *)(packed + next * panel_stride);
            int64_t ahead_lines = next_panels * panel_stride * 2 / LINE;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t r0 = m0 + rows * t / tiles, r1 = m0 + rows * (t + 1) / tiles;
                /* Tile t prefetches lines [t * pairs, (t + 1) * pairs) of the next group
                 * (a lone tile would only cover a quarter: the hardware prefetcher does
                 * better there). */
                int whole = tiles > 1 && (t + 1) * pairs <= ahead_lines;
                tile_dispatch((int)(r1 - r0), panels, x + r0 * ldx, ldx, w, panel_stride,
                              pairs, b, y + r0 * ldy + p0 * PANEL_COLS, ldy,
                              whole ? ahead + t * pairs * LINE : (const char *)w,
                              whole ? LINE : 0);
            }
        }
    }
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) times the weight packed by
 * bf16_gemm_pack, plus bias (float32 [n], or NULL). n a multiple of 16, k even:
 * returns -2 otherwise, 0 when done. */
int bf16_gemm(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
              const uint16_t *packed, int64_t n, int64_t k, const float *bias, uint16_t *y,
              int64_t ldy) {
    if (n % PANEL_COLS || k % 2) return -2;
    const int64_t panels = n / PANEL_COLS;
    int threads = num_threads < panels ? num_threads : (int)panels;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        /* omp_get_* without omp.h: the library links the OpenMP runtime torch loaded. */
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        gemm_panels(x, m, ldx, packed, k, bias, y, ldy, panels * t / nt,
                    panels * (t + 1) / nt);
    }
    return 0;
}

/* The weight w [n, k] (row-major bf16, a linear's) in bf16_gemm's layout: panel j
 * holds columns [16 j, 16 j + 16) as k/2 rows of 16 pairs (w[c, 2i], w[c, 2i + 1]).
 * Same size as w. Returns -2 for a shape bf16_gemm does not take. */
int bf16_gemm_pack(int num_threads, const uint16_t *w, int64_t n, int64_t k,
                   uint16_t *packed) {
    if (n % PANEL_COLS || k % 2) return -2;
    const int64_t panels = n / PANEL_COLS, pairs = k / 2;
    #pragma omp parallel for num_threads(num_threads > 1 ? num_threads : 1)
    for (int64_t j = 0; j < panels; j++) {
        uint16_t *panel = packed + j * pairs * 2 * PANEL_COLS;
        for (int64_t i = 0; i < pairs; i++)
            for (int c = 0; c < PANEL_COLS; c++) {
                const uint16_t *src = w + (j * PANEL_COLS + c) * k + 2 * i;
                panel[(i * PANEL_COLS + c) * 2] = src[0];
                panel[(i * PANEL_COLS + c) * 2 + 1] = src[1];
            }
    }
    return 0;
}

#else  /* no AVX512-BF16: the caller keeps oneDNN (or float32) */

int bf16_gemm_available(void) { return 0; }

int bf16_gemm(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
              const uint16_t *packed, int64_t n, int64_t k, const float *bias, uint16_t *y,
              int64_t ldy) {
    (void)num_threads, (void)x, (void)m, (void)ldx, (void)packed, (void)n, (void)k;
    (void)bias, (void)y, (void)ldy;
    return -3;
}

int bf16_gemm_pack(int num_threads, const uint16_t *w, int64_t n, int64_t k,
                   uint16_t *packed) {
    (void)num_threads, (void)w, (void)n, (void)k, (void)packed;
    return -3;
}

#endif
