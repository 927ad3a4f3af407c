/* bf16 linears, y [M, N] = x [M, K] W^T (+ bias), on CPUs with AVX512-BF16 (dense bf16
 * linears use it where there is no AMX; the weight-only int4/int8 ones everywhere, with
 * AMX tiles for the multiply where the CPU has them: see quant_gemm below).
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
 * Built and loaded by native.py; elsewhere than AVX512-BF16 it builds as a stub
 * that says so (bf16_gemm_available). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

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

static int amx_on(void);
static void amx_gemm_panels(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *packed,
                            int64_t k, const float *bias, uint16_t *y, int64_t ldy,
                            int64_t first, int64_t last);

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) times the weight packed by
 * bf16_gemm_pack, plus bias (float32 [n], or NULL). n a multiple of 16, k even:
 * returns -2 otherwise, 0 when done. Through AMX tiles where they are on, k is a
 * multiple of 32 (a whole A tile) and there are at least AMX_MIN_ROWS rows: on the
 * Sapphire Rapids Xeon (2 threads, the built-in model's projections) VDPBF16PS is
 * 1.18x faster at 1 row, even at 2, and 1.13x slower at 4, 2.3x at 16, 3.4x at 32. */
enum { AMX_MIN_ROWS = 2 };
int bf16_gemm(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
              const uint16_t *packed, int64_t n, int64_t k, const float *bias, uint16_t *y,
              int64_t ldy) {
    if (n % PANEL_COLS || k % 2) return -2;
    const int64_t panels = n / PANEL_COLS;
    const int amx = k % 32 == 0 && m >= AMX_MIN_ROWS && amx_on();
    int threads = num_threads < panels ? num_threads : (int)panels;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        /* omp_get_* without omp.h: the library links the OpenMP runtime torch loaded. */
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t first = panels * t / nt, last = panels * (t + 1) / nt;
        if (amx) amx_gemm_panels(x, m, ldx, packed, k, bias, y, ldy, first, last);
        else gemm_panels(x, m, ldx, packed, k, bias, y, ldy, first, last);
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

/* ---- weight-only int4 and int8 through the same tiles ---------------------------
 * At a few rows, reading a quarter or an eighth of the bytes is what counts (the
 * whole-stack C decoder covers int4 there); from ~8 rows on the arithmetic does, and
 * ATen's weight-only kernels multiply in float32 FMAs, re-dequantising the weights for
 * each small tile of rows (its int8 one: 4.6x slower than bf16 at 32 rows). Here each
 * group of panels is dequantised once, to bf16 in an L2-resident scratch, and every
 * row tile then runs the bf16 tiles over it. */

/* ATen's CPU int4 pack as AVX-512 builds lay it out (decoder.c has the details):
 * blocks of 64 columns, [n / 64, k, 32] bytes, byte j of row k holding column j in its
 * low nibble and column j + 32 in its high one, and a [k / 32, n, 2] bf16 (scale, zero)
 * table: w = (q - 8) scale + zero. Panel p of a block (its columns 16 p .. 16 p + 15)
 * is bytes 16 (p % 2) .. 16 (p % 2) + 15 of each row, nibble p / 2. */
enum { Q4_BLOCK_COLS = 64, QUANT_GROUP = 32 };

/* Word order taking [w0[0..15], w1[0..15]] (cvtne2ps) to pairs [w0[c], w1[c]]. */
static const uint16_t pair_order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                        7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                                        14, 30, 15, 31};

static inline __m512 q4_row(const uint8_t *bytes, __m128i shift, __m512 scale,
                            __m512 offset) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    q = _mm512_and_si512(_mm512_srl_epi32(q, shift), _mm512_set1_epi32(15));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, offset);
}

/* Panel j (columns 16 j ..) of the int4 weight, dequantised and rounded to bf16, in
 * bf16_gemm_pack's layout at out. With ahead (panel j + 4 is the caller's too), it also
 * asks for panel j + 4's (scale, zero) line of each group of k, and for quarter j % 4
 * of the block after its own (block j / 4 + 1), spread over its groups. Where a group
 * of four panels starts on a block, that is the next group's block, all four quarters;
 * where it does not (a thread's share starting mid-block, the usual case), the first
 * panels ask for part of the block the group's later panels read, and the rest for the
 * next group's first block. Asking instead for the whole block after the group's last
 * (always the next group's) measured slower: 30 layers at 8 and 21 rows, 14.5-16.0 and
 * 16.7-18.5 ms against 14.3-14.4 and 15.6-16.2. A decode step's few rows leave the
 * weight's stream from memory exposed otherwise (30 layers at 21 rows through AMX
 * tiles: 19.9-20.4 ms, 13.3-13.7 with the weight in the caches;
 * benchmarks/cpu/cold_weights.py), and the scale lines, K / 32 runs n * 4 bytes apart, no
 * prefetcher follows. */
static void q4_panel(const uint8_t *qweight, const uint16_t *scale_zero, int64_t n,
                     int64_t k, int64_t j, int ahead, uint16_t *out) {
    const int64_t p = j % 4, row_bytes = Q4_BLOCK_COLS / 2;
    const uint8_t *base = qweight + (j / 4) * k * row_bytes + (p % 2) * 16;
    const __m128i shift = _mm_cvtsi32_si128((int)(p / 2) * 4);
    const __m512i order = _mm512_loadu_si512(pair_order);
    const int64_t block_bytes = k * row_bytes;
    const int64_t step_bytes = QUANT_GROUP * row_bytes / 4;  /* of the quarter, per group */
    const char *next =
        ahead ? (const char *)qweight + (j / 4 + 1) * block_bytes + p * (block_bytes / 4) : NULL;
    for (int64_t g = 0; g < k / QUANT_GROUP; g++) {
        if (next != NULL) {
            _mm_prefetch((const char *)(scale_zero + (g * n + (j + 4) * PANEL_COLS) * 2),
                         _MM_HINT_T1);
            for (int64_t b = 0; b < step_bytes; b += 64)
                _mm_prefetch(next + g * step_bytes + b, _MM_HINT_T1);
        }
        /* 16 (scale, zero) bf16 pairs, one 32-bit lane each: bf16 is float's top half */
        __m512i sz = _mm512_loadu_si512(scale_zero + (g * n + j * PANEL_COLS) * 2);
        __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
        __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(-65536)));
        __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
        for (int64_t r = g * QUANT_GROUP; r < (g + 1) * QUANT_GROUP; r += 2) {
            __m512 w0 = q4_row(base + r * row_bytes, shift, scale, offset);
            __m512 w1 = q4_row(base + (r + 1) * row_bytes, shift, scale, offset);
            __m512i both = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
            _mm512_storeu_si512(out + r * PANEL_COLS, _mm512_permutexvar_epi16(order, both));
        }
    }
}

/* r[i][j] <- r[j][i] for 16 x 16 32-bit lanes: pairs, then 64-bit halves within each
 * 128-bit lane, then the lanes themselves. */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Panel j of an int8 weight (ATen's int8 pack: [n, k] int8 rows, one bf16 scale per
 * output column: w = q scale), dequantised and rounded to bf16, in bf16_gemm_pack's
 * layout at out. Each column's 32 k values become 16 pairs in one register; 16
 * columns' registers, transposed, are 16 rows of the panel. */
static void q8_panel(const int8_t *qweight, const uint16_t *scales, int64_t k, int64_t j,
                     int ahead, uint16_t *out) {
    __m512 scale[PANEL_COLS];
    for (int c = 0; c < PANEL_COLS; c++)
        scale[c] = _mm512_set1_ps(bf16_to_f32(scales[j * PANEL_COLS + c]));
    /* with ahead, panel j + 4's rows (contiguous, as q4_panel's next block) are asked for
     * meanwhile, spread over the groups: the built-in model's LM head at 21 rows, its
     * weight out of the caches, 3.6-3.9 -> 3.0-3.6 ms (2.6-3.0 in the caches) */
    const char *next = ahead ? (const char *)(qweight + (j + 4) * PANEL_COLS * k) : NULL;
    const int64_t step_bytes = PANEL_COLS * QUANT_GROUP;  /* of panel j + 4, per group */
    for (int64_t k0 = 0; k0 < k; k0 += QUANT_GROUP) {
        if (ahead)
            for (int64_t b = 0; b < step_bytes; b += 64)
                _mm_prefetch(next + k0 / QUANT_GROUP * step_bytes + b, _MM_HINT_T1);
        __m512i r[PANEL_COLS];
        for (int c = 0; c < PANEL_COLS; c++) {
            const int8_t *src = qweight + (j * PANEL_COLS + c) * k + k0;
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)src)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(src + 16))));
            r[c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale[c]),
                                                _mm512_mul_ps(lo, scale[c]));
        }
        transpose16x16(r);
        for (int p = 0; p < PANEL_COLS; p++)
            _mm512_storeu_si512(out + (k0 / 2 + p) * 2 * PANEL_COLS, r[p]);
    }
}

typedef struct {
    int bits;                /* 4 or 8 */
    const uint8_t *qweight;  /* ATen's pack (see above) */
    const uint16_t *scales;  /* int4: [k / 32, n, 2] (scale, zero); int8: [n] */
    int64_t n, k;
} quant_weight;

/* ---- AMX: the same dequantised panels through TDPBF16PS ---------------------------
 * A panel's layout (K/2 rows of 16 column pairs, 64 bytes a row) is exactly AMX's B
 * operand: 16 of its rows are one B tile (32 k values x 16 columns). A tile of up to 16
 * rows x 4 panels keeps its float32 sums in four C tiles (tmm0-3); each 32-wide step of
 * K loads the rows' A tile once (tmm4) and each panel's B tile (tmm5/6, alternating) and
 * multiplies: one TDPBF16PS does the work of 16 x 16 VDPBF16PS. Built where the
 * compiler targets AMX (-march=native on an AMX CPU); used once Linux grants the tile
 * state (arch_prctl), and switchable for tests (gemm_use_amx). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

enum { AMX_ROWS = 16, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

static int amx_wanted = 1, amx_granted = -1;

static int amx_on(void) {
    if (amx_granted < 0)  /* once per process; the kernel keeps the grant */
        amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_wanted && amx_granted;
}

int gemm_use_amx(int want) {
    if (want >= 0) amx_wanted = want != 0;
    return amx_on();
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* This thread's tiles for blocks of ``rows`` rows: C tmm0-3 and A tmm4 rows x 64 bytes,
 * B tmm5/6 16 x 64 bytes. */
static void amx_configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    for (int t = 5; t < 7; t++) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* The C tile of panel P (an immediate, as tile numbers must be) out to y: its rows
 * through a float32 buffer, plus bias, rounded to bf16 once. */
#define AMX_STORE(P)                                                                     \
    do {                                                                                 \
        _tile_stored(P, out, 64);                                                        \
        for (int r = 0; r < rows; r++) {                                                 \
            __m512 sum = _mm512_load_ps(out[r]);                                         \
            if (bias != NULL) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + P * PANEL_COLS)); \
            _mm256_storeu_si256((__m256i *)(y + r * ldy + P * PANEL_COLS),               \
                                (__m256i)_mm512_cvtneps_pbh(sum));                       \
        }                                                                                \
    } while (0)

/* rows (<= 16, as configured) x panels (<= 4) outputs over all of K (a multiple of 32). */
static void amx_tile(int rows, int panels, const uint16_t *x, int64_t ldx, const uint16_t *w,
                     int64_t panel_stride, int64_t k, const float *bias, uint16_t *y,
                     int64_t ldy) {
    float out[AMX_ROWS][PANEL_COLS] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
        const uint16_t *b = w + k0 * PANEL_COLS;  /* pair k0 / 2 of panel 0 */
        _tile_loadd(4, x + k0, ldx * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (panels > 1) { _tile_loadd(6, b + panel_stride, 64); _tile_dpbf16ps(1, 4, 6); }
        if (panels > 2) { _tile_loadd(5, b + 2 * panel_stride, 64); _tile_dpbf16ps(2, 4, 5); }
        if (panels > 3) { _tile_loadd(6, b + 3 * panel_stride, 64); _tile_dpbf16ps(3, 4, 6); }
    }
    AMX_STORE(0);
    if (panels > 1) AMX_STORE(1);
    if (panels > 2) AMX_STORE(2);
    if (panels > 3) AMX_STORE(3);
}

/* Rows [0, m) over one dequantised group of panels, 16 rows a tile; ``configured``
 * is the row count this thread's tiles are set up for (0: none yet). */
static void amx_rows(int64_t m, int panels, const uint16_t *x, int64_t ldx,
                     const uint16_t *w, int64_t panel_stride, int64_t k, const float *bias,
                     uint16_t *y, int64_t ldy, int *configured) {
    for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS) {
        int rows = m - r0 < AMX_ROWS ? (int)(m - r0) : AMX_ROWS;
        if (rows != *configured) amx_configure(rows), *configured = rows;
        amx_tile(rows, panels, x + r0 * ldx, ldx, w, panel_stride, k, bias, y + r0 * ldy, ldy);
    }
}

/* One thread's panels [first, last) of a dense packed weight: its panels are B tiles
 * as they are (no dequantisation), each group of 4 under every tile of 16 rows. */
static void amx_gemm_panels(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *packed,
                            int64_t k, const float *bias, uint16_t *y, int64_t ldy,
                            int64_t first, int64_t last) {
    const int64_t panel_stride = k * PANEL_COLS;
    int configured = 0;
    for (int64_t p0 = first; p0 < last; p0 += TILE_PANELS) {
        int panels = last - p0 < TILE_PANELS ? (int)(last - p0) : TILE_PANELS;
        amx_rows(m, panels, x, ldx, packed + p0 * panel_stride, panel_stride, k,
                 bias == NULL ? NULL : bias + p0 * PANEL_COLS, y + p0 * PANEL_COLS, ldy,
                 &configured);
    }
    _tile_release();
}
#else
static int amx_on(void) { return 0; }
int gemm_use_amx(int want) { (void)want; return 0; }
static void amx_gemm_panels(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *packed,
                            int64_t k, const float *bias, uint16_t *y, int64_t ldy,
                            int64_t first, int64_t last) {
    (void)x, (void)m, (void)ldx, (void)packed, (void)k, (void)bias, (void)y, (void)ldy;
    (void)first, (void)last;
}
#endif

static void dequant_panel(const quant_weight *w, int64_t j, int ahead, uint16_t *out) {
    if (w->bits == 4) q4_panel(w->qweight, w->scales, w->n, w->k, j, ahead, out);
    else q8_panel((const int8_t *)w->qweight, w->scales, w->k, j, ahead, out);
}

/* One thread's panels [first, last): each group of TILE_PANELS dequantised once into
 * scratch, then every tile of rows over it (AMX tiles where ``amx``). */
static void quant_gemm_panels(const uint16_t *x, int64_t m, int64_t ldx, const quant_weight *w,
                              const float *bias, uint16_t *y, int64_t ldy, int64_t first,
                              int64_t last, uint16_t *scratch, int amx) {
    const int64_t pairs = w->k / 2, panel_stride = pairs * 2 * PANEL_COLS;
    int configured = 0;
    for (int64_t p0 = first; p0 < last; p0 += TILE_PANELS) {
        int panels = last - p0 < TILE_PANELS ? (int)(last - p0) : TILE_PANELS;
        const int ahead = p0 + 2 * TILE_PANELS <= last;
        for (int q = 0; q < panels; q++)
            dequant_panel(w, p0 + q, ahead, scratch + q * panel_stride);
        const float *b = bias == NULL ? NULL : bias + p0 * PANEL_COLS;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx) {
            amx_rows(m, panels, x, ldx, scratch, panel_stride, w->k, b, y + p0 * PANEL_COLS,
                     ldy, &configured);
            continue;
        }
#endif
        (void)amx, (void)configured;
        for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
            int64_t rows = m - m0 < CHUNK_ROWS ? m - m0 : CHUNK_ROWS;
            int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t r0 = m0 + rows * t / tiles, r1 = m0 + rows * (t + 1) / tiles;
                tile_dispatch((int)(r1 - r0), panels, x + r0 * ldx, ldx, scratch,
                              panel_stride, pairs, b, y + r0 * ldy + p0 * PANEL_COLS, ldy,
                              (const char *)scratch, 0);
            }
        }
    }
}

/* y [m, n] = x [m, k] times a weight-only int4 (bits 4) or int8 (bits 8) weight in
 * ATen's pack (see above), plus bias (float32 [n], or NULL). k a multiple of 32; n of
 * 64 (int4) or 16 (int8): returns -2 otherwise, -1 out of memory, 0 when done. */
int quant_gemm(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
               const uint8_t *qweight, const uint16_t *scales, int bits, int64_t n, int64_t k,
               const float *bias, uint16_t *y, int64_t ldy) {
    if ((bits != 4 && bits != 8) || k % QUANT_GROUP
            || n % (bits == 4 ? Q4_BLOCK_COLS : PANEL_COLS))
        return -2;
    const quant_weight w = {bits, qweight, scales, n, k};
    const int64_t panels = n / PANEL_COLS;
    const size_t scratch_bytes = (size_t)TILE_PANELS * (size_t)k * PANEL_COLS * 2;
    int threads = num_threads < panels ? num_threads : (int)panels, failed = 0;
    const int amx = amx_on();
    #pragma omp parallel num_threads(threads) if(threads > 1) reduction(|:failed)
    {
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t *scratch = aligned_alloc(64, scratch_bytes);
        if (scratch == NULL) {
            failed = 1;
        } else {
            quant_gemm_panels(x, m, ldx, &w, bias, y, ldy, panels * t / nt,
                              panels * (t + 1) / nt, scratch, amx);
            free(scratch);
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx) _tile_release();
#endif
    }
    return failed ? -1 : 0;
}

#else  /* no AVX512-BF16: the caller keeps oneDNN (or float32) */

int bf16_gemm_available(void) { return 0; }
int gemm_use_amx(int want) { (void)want; return 0; }

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

int quant_gemm(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
               const uint8_t *qweight, const uint16_t *scales, int bits, int64_t n, int64_t k,
               const float *bias, uint16_t *y, int64_t ldy) {
    (void)num_threads, (void)x, (void)m, (void)ldx, (void)qweight, (void)scales, (void)bits;
    (void)n, (void)k, (void)bias, (void)y, (void)ldy;
    return -3;
}

#endif
