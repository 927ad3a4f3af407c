/* Int8 weight-only products (a decode step's LM head), streaming the weight once.
 *
 * The weight is QuantizedLinear's int8 layout, which ATen's _weight_int8pack_mm reads:
 * [N, K] int8 codes, row n scaled by scales[n] (bf16): y[m, n] = scales[n] *
 * sum_k x[m, k] q[n, k], rounded to bf16 once. ATen's kernel for one row streams the
 * built-in model's 28 MB LM head at ~9-12 GB/s on two cores, a quarter of a single
 * stream's decode step; this one sign-extends 16 codes to float32 lanes and multiplies
 * them by up to 4 rows of x at once, 4 weight rows at a time (2 and 2 on AVX2), and a
 * second group of rows reads the weight tile again from L1, so the weight streams from
 * memory once. From Q8_MANY_ROWS rows (a decode step of many sequences), an AVX-512 or
 * AVX2 build runs a GEMM over panels instead (q8_rows_many); where the CPU has AVX-512
 * VNNI and the caller asks, from
 * Q8_INT8_ROWS rows a GEMM over int8 panels with x rounded to int8 (q8_rows_int8). Built
 * into the one library by native.py; declared in kernels.h.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "kernels.h"
#include "panel.h"
#include "panel_int8.h"

/* A tile: Q8_TOKENS rows of x sharing each weight load, Q8_WROWS weight rows at a time,
 * their sums in registers (16 on AVX-512's 32; AVX2's 16 half-width ones hold 4). */
#if defined(__AVX512F__)
#define Q8_TOKENS 4
#define Q8_WROWS 4
#else
#define Q8_TOKENS 2
#define Q8_WROWS 2
#endif
#define Q8_MANY_ROWS 12  /* rows from which q8_rows_many takes whole panels (PANEL_GEMMS) */
#define Q8_PREFETCH 4096  /* bytes: 18.6 GB/s streaming on a 2-core Xeon, 18.1 at 16K, 13.3 at 64K */

/* 16 int8 codes as float32 lanes. */
static inline v16f codes16(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m256 halves[2] = {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
    v16f out;
    memcpy(&out, halves, sizeof out);
    return out;
#else
    v16f out;
    for (int i = 0; i < 16; i++) out[i] = p[i];
    return out;
#endif
}

/* The tiles' registers: 16 lanes, except on AVX2, where they are its own 8 (16-lane
 * vectors, two AVX2 registers each, would live on the stack: 3x slower than ATen). */
#if defined(AVX2_ONLY)
typedef float q8_vec __attribute__((vector_size(32)));

static inline q8_vec q8_codes(const int8_t *p) {  /* 8 int8 codes as float32 lanes */
    return (q8_vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float q8_sum(q8_vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
typedef v16f q8_vec;

static inline q8_vec q8_codes(const int8_t *p) { return codes16(p); }

static inline float q8_sum(v16f v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
#endif
}
#endif
#define Q8_LANES ((int)(sizeof(q8_vec) / sizeof(float)))

/* The tile's sums acc[t][r] (token t, weight row n0 + r) scaled, rounded to bf16 (+
 * bias, rounded again, as the torch path adds it) into y. A macro: the sums must stay
 * in registers, which GCC gives up once their array's address is passed on. */
#define Q8_STORE(acc, m, wr, scales, bias, n0, y, ldy)                              \
    for (int t_ = 0; t_ < (m); t_++)                                                \
        for (int r_ = 0; r_ < (wr); r_++) {                                         \
            float v_ = q8_sum((acc)[t_][r_]) * bf16_to_f32((scales)[(n0) + r_]);     \
            if ((bias) != NULL) v_ = bf16_to_f32(f32_to_bf16(v_)) + (bias)[(n0) + r_]; \
            (y)[t_ * (ldy) + (n0) + r_] = f32_to_bf16(v_);                          \
        }

/* Weight rows [n0, n0 + wr) for tokens [0, m) (m <= Q8_TOKENS, wr <= Q8_WROWS), with m
 * and wr known to the compiler where it inlines. */
static inline __attribute__((always_inline)) void q8_tile(
        const float *xf, int m, int wr, const int8_t *q, const uint16_t *scales,
        const float *bias, int64_t n0, int64_t k, uint16_t *y, int64_t ldy) {
    q8_vec acc[Q8_TOKENS][Q8_WROWS];
    for (int t = 0; t < m; t++)
        for (int r = 0; r < wr; r++) acc[t][r] = (q8_vec){0};
    /* Q8_PREFETCH bytes on in the thread's stream, a line per 64 bytes of this tile:
     * the hardware prefetcher alone kept a thread at ~7 GB/s on a Xeon. */
    const uintptr_t ahead = (uintptr_t)(q + n0 * k) + Q8_PREFETCH;  /* may lie past q */
    for (int64_t k0 = 0; k0 < k; k0 += Q8_LANES) {
        if ((k0 & 63) == 0)
            for (int r = 0; r < wr; r++)
                __builtin_prefetch((const void *)(ahead + (uintptr_t)(r * k + k0)), 0, 3);
        q8_vec w[Q8_WROWS];
        for (int r = 0; r < wr; r++) w[r] = q8_codes(q + (n0 + r) * k + k0);
        for (int t = 0; t < m; t++) {
            q8_vec xv;
            memcpy(&xv, xf + t * k + k0, sizeof xv);
            for (int r = 0; r < wr; r++) acc[t][r] += xv * w[r];
        }
    }
    Q8_STORE(acc, m, wr, scales, bias, n0, y, ldy);
}

static void q8_tile_any(const float *xf, int m, int wr, const int8_t *q, const uint16_t *scales,
                        const float *bias, int64_t n0, int64_t k, uint16_t *y, int64_t ldy) {
#define Q8_CASE(M_, R_) \
    case (M_ - 1) * Q8_WROWS + R_ - 1: q8_tile(xf, M_, R_, q, scales, bias, n0, k, y, ldy); break;
    switch ((m - 1) * Q8_WROWS + wr - 1) {
        Q8_CASE(1, 1) Q8_CASE(1, 2) Q8_CASE(2, 1) Q8_CASE(2, 2)
#if Q8_WROWS == 4
        Q8_CASE(1, 3) Q8_CASE(1, 4) Q8_CASE(2, 3) Q8_CASE(2, 4)
        Q8_CASE(3, 1) Q8_CASE(3, 2) Q8_CASE(3, 3) Q8_CASE(3, 4)
        Q8_CASE(4, 1) Q8_CASE(4, 2) Q8_CASE(4, 3) Q8_CASE(4, 4)
#endif
    }
#undef Q8_CASE
}

#if defined(PANEL_GEMMS)
/* Many rows (from Q8_MANY_ROWS, where panel.h builds its GEMM): a GEMM over panels of the weight
 * (panel.h), each converted to float32 and transposed once for all the rows. The few-row
 * tile above converts the codes again for each 4 rows of x and reduces each sum across
 * its lanes: at 32 rows those, not memory, bound it. */

#if PANEL_VECS == 2
/* 16 rows of 16 floats (r[i]: row i) transposed in place (r[j]: column j). */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {  /* per 128-bit lane: pairs of rows interleaved */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* r[4i + j], lane L: column 4L + j of rows 4i..4i+3 */
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) {  /* the four 128-bit lanes of column 4L + j gathered */
        __m512 s0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        __m512 s1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        __m512 s2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        __m512 s3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        t[j] = _mm512_shuffle_f32x4(s0, s2, 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(s1, s3, 0x88);
        t[8 + j] = _mm512_shuffle_f32x4(s0, s2, 0xdd);
        t[12 + j] = _mm512_shuffle_f32x4(s1, s3, 0xdd);
    }
    for (int j = 0; j < 16; j++) r[j] = t[j];
}

/* The 16 x 16 block of codes at (weight row n0 + 16h, column kb), transposed into the
 * panel; the next panel's line for each 4 rows asked for (see q8_panel). */
static inline __attribute__((always_inline)) void q8_block(
        const int8_t *q, int64_t n0, int64_t k, int64_t kb, int64_t k0, int h,
        const int8_t *next, float *panel) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) {
        const int64_t row = h * 16 + i, step = kb / 16 * PANEL_COLS + row;
        if (next != NULL && step % 4 == 0) __builtin_prefetch(next + step * 16, 0, 3);
        r[i] = (__m512)codes16(q + (n0 + row) * k + kb);
    }
    transpose16(r);
    for (int j = 0; j < 16; j++)
        _mm512_storeu_ps(panel + (kb - k0 + j) * PANEL_COLS + h * 16, r[j]);
}
#else
/* 8 rows of 8 floats (r[i]: row i) transposed in place (r[j]: column j). */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: pairs of rows interleaved */
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {  /* u[4i + j], lane L: column 4L + j of rows 4i..4i+3 */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {  /* the two 128-bit lanes of column j (and j + 4) */
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}

/* q8_block for AVX2 (16-column panels): the 16 x 16 block of codes at (weight row n0,
 * column kb) as four 8 x 8 transposes. */
static inline __attribute__((always_inline)) void q8_block(
        const int8_t *q, int64_t n0, int64_t k, int64_t kb, int64_t k0, int h,
        const int8_t *next, float *panel) {
    (void)h;  /* one block of 16 rows per panel */
    for (int rh = 0; rh < 2; rh++) {
        __m256 lo[8], hi[8];  /* columns kb..kb+7 and kb+8..kb+15 of 8 weight rows */
        for (int i = 0; i < 8; i++) {
            const int64_t row = rh * 8 + i, step = kb / 16 * PANEL_COLS + row;
            if (next != NULL && step % 4 == 0) __builtin_prefetch(next + step * 16, 0, 3);
            lo[i] = (__m256)q8_codes(q + (n0 + row) * k + kb);
            hi[i] = (__m256)q8_codes(q + (n0 + row) * k + kb + 8);
        }
        transpose8(lo);
        transpose8(hi);
        for (int j = 0; j < 8; j++) {
            _mm256_storeu_ps(panel + (kb - k0 + j) * PANEL_COLS + rh * 8, lo[j]);
            _mm256_storeu_ps(panel + (kb - k0 + 8 + j) * PANEL_COLS + rh * 8, hi[j]);
        }
    }
}
#endif

/* panel [k1 - k0, PANEL_COLS] = columns [k0, k1) of weight rows [n0, n0 + PANEL_COLS),
 * transposed, as float32 codes; the next panel's bytes (next, or NULL) asked for
 * meanwhile, a line per 64 bytes read, spread over the panel's chunks. */
static void q8_panel(const int8_t *q, int64_t n0, int64_t k, int64_t k0, int64_t k1,
                     const int8_t *next, float *panel) {
    for (int64_t kb = k0; kb < k1; kb += 16)
        for (int h = 0; h < PANEL_VECS; h++) q8_block(q, n0, k, kb, k0, h, next, panel);
}

/* Weight rows [first, last) (whole panels) for all m rows of xf; scratch:
 * PANEL_CHUNK * PANEL_COLS + m * PANEL_COLS floats. Sums scaled and rounded as
 * Q8_STORE does. */
static void q8_rows_many(const float *xf, int64_t m, const int8_t *q, const uint16_t *scales,
                         const float *bias, int64_t first, int64_t last, int64_t k,
                         float *scratch, uint16_t *y, int64_t ldy) {
    float *panel = scratch, *sums = scratch + PANEL_CHUNK * PANEL_COLS;
    for (int64_t n0 = first; n0 < last; n0 += PANEL_COLS) {
        const int8_t *next = n0 + 2 * PANEL_COLS <= last ? q + (n0 + PANEL_COLS) * k : NULL;
        for (int64_t k0 = 0; k0 < k; k0 += PANEL_CHUNK) {
            const int64_t k1 = k0 + PANEL_CHUNK < k ? k0 + PANEL_CHUNK : k;
            q8_panel(q, n0, k, k0, k1, next, panel);
            panel_rows(xf, k, m, panel, k0, k1, sums);
        }
        v16f scale[PANEL_VECS], add[PANEL_VECS];
        for (int v = 0; v < PANEL_VECS; v++) {
            scale[v] = load16_bf16(scales + n0 + 16 * v);
            if (bias != NULL) memcpy(&add[v], bias + n0 + 16 * v, sizeof add[v]);
        }
        for (int64_t t = 0; t < m; t++)
            for (int v = 0; v < PANEL_VECS; v++) {
                v16f sum;
                memcpy(&sum, sums + t * PANEL_COLS + 16 * v, sizeof sum);
                uint16_t *out = y + t * ldy + n0 + 16 * v;
                store16_bf16(out, sum * scale[v]);
                if (bias != NULL) store16_bf16(out, load16_bf16(out) + add[v]);
            }
    }
}
#endif

#if defined(PANEL_INT8_VNNI) || (defined(PANEL_INT8) && defined(AVX2_ONLY))
#define Q8_INT8 1
#endif

#if defined(Q8_INT8)
/* From Q8_INT8_ROWS rows, where the caller asks (int8_x), x rounded to int8 as for the
 * int4 products (panel_int8.h's xq_rows, per group of 32) and the weight multiplied by
 * VPDPBUSD over panels of its codes (AVX-512 VNNI), or by VPMADDUBSW over two int4
 * panels of them (AVX2: q8_panel_nibbles). Both multiply an unsigned byte by a signed
 * one: the panels hold the codes + 128 (the sign bit flipped), so a row's sum is
 * sum_g d_g dot_g - 128 sum_g d_g sum(codes_g), the second term the same for every
 * column (q8_rows_int8 subtracts it once). Each weight row's 4 consecutive codes are
 * already one int32 lane's bytes: a panel is transposes of int32s (16 x 16, transpose16;
 * AVX2: 8 x 8, transpose8). Both builds sum the same integers and scale them alike:
 * the same bits. From 4 rows (gemm.py's Q8_INT8_MIN_ROWS): the built-in model's LM head
 * [49152 x 576], Ice Lake Xeon, 2 threads, float32 path / int8
 * (benchmarks/cpu/int8_products.py): 0.85-1.13x at 3 rows, 1.2x at 4, 1.6x at 5, 2.3x at
 * 12, 2.3-2.6x at 16-32, 2.7-3.0x at 64-96. */
#define Q8_INT8_ROWS 4
#endif

#if defined(PANEL_INT8_VNNI)

/* panel [(k1 - k0) / 4][32][4] = weight rows n0..n0+31 over columns [k0, k1) (multiples
 * of 64), + 128, as bytes; the next panel's rows (next, or NULL) asked for meanwhile, a
 * line per row per 64 columns. */
static void q8_panel_u8(const int8_t *q, int64_t n0, int64_t k, int64_t k0, int64_t k1,
                        const int8_t *next, uint8_t *panel) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t kb = k0; kb < k1; kb += 64)
        for (int h = 0; h < 2; h++) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t row = 16 * h + i;
                if (next != NULL) __builtin_prefetch(next + row * k + kb, 0, 3);
                r[i] = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_loadu_si512(q + (n0 + row) * k + kb), flip));
            }
            transpose16(r);  /* r[j]: the int32 of columns kb + 4j.. of the 16 rows */
            for (int j = 0; j < 16; j++)
                _mm512_storeu_si512(panel + ((kb - k0) / 4 + j) * 4 * PANEL8_COLS + 64 * h,
                                    _mm512_castps_si512(r[j]));
        }
}

#endif

#if defined(Q8_INT8) && defined(AVX2_ONLY)
/* q8_panel_u8 for AVX2's 16-column int4 panels: weight rows n0..n0+15 over columns
 * [k0, k1) (multiples of 32), + 128, split into nibbles, high ones into panel [(k1 -
 * k0) / 4][16][4] and low ones PANEL8_CHUNK * PANEL8_COLS bytes on (panel8_group_q8);
 * the next panel's rows asked for meanwhile, a line per row per 64 columns. */
static void q8_panel_nibbles(const int8_t *q, int64_t n0, int64_t k, int64_t k0, int64_t k1,
                             const int8_t *next, uint8_t *panel) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), low4 = _mm256_set1_epi8(15);
    uint8_t *low_panel = panel + PANEL8_CHUNK * PANEL8_COLS;
    for (int64_t kb = k0; kb < k1; kb += 32)
        for (int h = 0; h < 2; h++) {
            __m256 high[8], low[8];  /* 8 weight rows' 32 columns: 8 int32 quads each */
            for (int i = 0; i < 8; i++) {
                const int64_t row = 8 * h + i;
                if (next != NULL && kb % 64 == 0) __builtin_prefetch(next + row * k + kb, 0, 3);
                const __m256i u = _mm256_xor_si256(
                    _mm256_loadu_si256((const __m256i *)(q + (n0 + row) * k + kb)), flip);
                high[i] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srli_epi16(u, 4), low4));
                low[i] = _mm256_castsi256_ps(_mm256_and_si256(u, low4));
            }
            transpose8(high);  /* [j]: the quad of columns kb + 4j.. of the 8 rows */
            transpose8(low);
            for (int j = 0; j < 8; j++) {
                const int64_t at = ((kb - k0) / 4 + j) * 4 * PANEL8_COLS + 32 * h;
                _mm256_storeu_si256((__m256i *)(panel + at), _mm256_castps_si256(high[j]));
                _mm256_storeu_si256((__m256i *)(low_panel + at), _mm256_castps_si256(low[j]));
            }
        }
}
#endif

#if defined(Q8_INT8)
/* The int8 panels' bytes a thread keeps: one panel (VNNI), or two of nibbles (AVX2). */
#if defined(PANEL_INT8_VNNI)
#define Q8_PANEL_BYTES (PANEL8_CHUNK * PANEL8_COLS)
#else
#define Q8_PANEL_BYTES (2 * PANEL8_CHUNK * PANEL8_COLS)
#endif

/* Weight rows [first, last) (whole panels of PANEL8_COLS rows) for m rows of x as codes
 * (xq_rows; shift: 128 sum_g d_g sum(codes_g) per row); panel and sums on the caller's
 * stack. Sums scaled, rounded and biased as q8_rows_many stores them. */
static void q8_rows_int8(const int8_t *codes, const float *step, const float *csum,
                         const float *shift, int64_t m, const int8_t *q,
                         const uint16_t *scales, const float *bias, int64_t first,
                         int64_t last, int64_t k, uint8_t *panel, float *sums, uint16_t *y,
                         int64_t ldy) {
    for (int64_t n0 = first; n0 < last; n0 += PANEL8_COLS) {
        const int8_t *next = n0 + 2 * PANEL8_COLS <= last ? q + (n0 + PANEL8_COLS) * k : NULL;
        for (int64_t k0 = 0; k0 < k; k0 += PANEL8_CHUNK) {
            const int64_t k1 = k0 + PANEL8_CHUNK < k ? k0 + PANEL8_CHUNK : k;
#if defined(PANEL_INT8_VNNI)
            q8_panel_u8(q, n0, k, k0, k1, next, panel);
            panel8_rows(codes, step, csum, k, m, panel, NULL, 0, k0, k1, sums);
#else
            (void)csum;
            q8_panel_nibbles(q, n0, k, k0, k1, next, panel);
            panel8_rows_q8(codes, step, k, m, panel, k0, k1, sums);
#endif
        }
        v16f scale[PANEL8_COLS / 16], add[PANEL8_COLS / 16];
        for (int v = 0; v < PANEL8_COLS / 16; v++) {
            scale[v] = load16_bf16(scales + n0 + 16 * v);
            if (bias != NULL) memcpy(&add[v], bias + n0 + 16 * v, sizeof add[v]);
        }
        for (int64_t t = 0; t < m; t++)
            for (int v = 0; v < PANEL8_COLS / 16; v++) {
                v16f sum;
                memcpy(&sum, sums + t * PANEL8_COLS + 16 * v, sizeof sum);
                uint16_t *out = y + t * ldy + n0 + 16 * v;
                store16_bf16(out, (sum - shift[t]) * scale[v]);
                if (bias != NULL) store16_bf16(out, load16_bf16(out) + add[v]);
            }
    }
}

/* q8_rows_bf16 with x rounded to int8 (k a multiple of 64, n of PANEL8_COLS: 32, 16 on
 * AVX2): the threads take even shares of the panels, PANEL_ROW_BLOCK rows of x at a
 * time. -1: out of memory. */
static int q8_rows_bf16_int8(int num_threads, const uint16_t *x, int64_t m, int64_t ldx,
                             const int8_t *q, const uint16_t *scales, int64_t n, int64_t k,
                             const float *bias, uint16_t *y, int64_t ldy) {
    const int64_t groups = k / PANEL8_Q, panels = n / PANEL8_COLS;
    int8_t *codes = malloc((size_t)(m * k) + sizeof(float) * (size_t)(m * (2 * groups + 1)));
    if (codes == NULL) return -1;
    float *step = (float *)(codes + m * k), *csum = step + m * groups, *shift = csum + m * groups;
    int shares = num_threads < panels ? num_threads : (int)panels;
    if (shares < 1) shares = 1;
    #pragma omp parallel num_threads(shares)
    {
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        const int s = omp_get_thread_num(), nt = omp_get_num_threads();
        xq_rows_share(x, ldx, m, k, codes, step, csum, s, nt);
        for (int64_t t = m * s / nt; t < m * (s + 1) / nt; t++) {
            float sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) sum += csum[t * groups + g];
            shift[t] = 128.0f * sum;
        }
        #pragma omp barrier
        uint8_t panel[Q8_PANEL_BYTES] __attribute__((aligned(64)));
        float sums[PANEL_ROW_BLOCK * PANEL8_COLS] __attribute__((aligned(64)));
        const int64_t first = panels * s / nt * PANEL8_COLS;
        const int64_t last = panels * (s + 1) / nt * PANEL8_COLS;
        for (int64_t r0 = 0; r0 < m; r0 += PANEL_ROW_BLOCK)
            q8_rows_int8(codes + r0 * k, step + r0 * groups, csum + r0 * groups, shift + r0,
                         m - r0 < PANEL_ROW_BLOCK ? m - r0 : PANEL_ROW_BLOCK, q, scales, bias,
                         first, last, k, panel, sums, y + r0 * ldy, ldy);
    }
    free(codes);
    return 0;
}
#endif

/* y [m, n] = x [m, k] (bf16, rows ldx apart) times the int8 weight, rounded to bf16;
 * bias (float32 [n], or NULL) added to the rounded product and rounded again, as the
 * torch path adds it. k a multiple of 16. int8_x: from Q8_INT8_ROWS rows round x to
 * int8 where built (k a multiple of 64, n of PANEL8_COLS: 32, 16 on AVX2). Returns 0,
 * -1 out of memory, -2 a shape it does not take. */
int q8_rows_bf16(int num_threads, const uint16_t *x, int64_t m, int64_t ldx, const int8_t *q,
                 const uint16_t *scales, int64_t n, int64_t k, const float *bias, uint16_t *y,
                 int64_t ldy, int int8_x) {
    if (k % 16 || k <= 0 || n <= 0 || m < 0) return -2;
#if defined(Q8_INT8)
    if (int8_x && m >= Q8_INT8_ROWS && k % 64 == 0 && n % PANEL8_COLS == 0)
        return q8_rows_bf16_int8(num_threads, x, m, ldx, q, scales, n, k, bias, y, ldy);
#else
    (void)int8_x;
#endif
    float *xf = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1) * (size_t)k);
    if (xf == NULL) return -1;
    for (int64_t t = 0; t < m; t++)
        for (int64_t i = 0; i < k; i++) xf[t * k + i] = bf16_to_f32(x[t * ldx + i]);
    /* Threads take even shares of 16-row units: each streams one contiguous range. */
    const int64_t units = (n + 15) / 16;
    int threads = num_threads < units ? num_threads : (int)units;
    if (threads < 1) threads = 1;
    #pragma omp parallel for num_threads(threads) schedule(static, 1) if(threads > 1)
    for (int s = 0; s < threads; s++) {
        int64_t first = units * s / threads * 16, last = units * (s + 1) / threads * 16;
        if (last > n) last = n;
#if defined(PANEL_GEMMS)
        /* whole panels here, the rest below (and all of them, if out of memory for the
         * panel: the tiles need none) */
        const int64_t end = first + (last - first) / PANEL_COLS * PANEL_COLS;
        float *panel = m >= Q8_MANY_ROWS && end > first
            ? malloc(sizeof(float) * PANEL_COLS * (PANEL_CHUNK + PANEL_ROW_BLOCK)) : NULL;
        if (panel != NULL) {
            for (int64_t r0 = 0; r0 < m; r0 += PANEL_ROW_BLOCK)
                q8_rows_many(xf + r0 * k, m - r0 < PANEL_ROW_BLOCK ? m - r0 : PANEL_ROW_BLOCK,
                             q, scales, bias, first, end, k, panel, y + r0 * ldy, ldy);
            free(panel);
            first = end;
        }
#endif
        for (int64_t n0 = first; n0 < last; n0 += Q8_WROWS) {
            int wr = last - n0 < Q8_WROWS ? (int)(last - n0) : Q8_WROWS;
            for (int64_t t0 = 0; t0 < m; t0 += Q8_TOKENS) {  /* the tile from L1 again */
                int mt = m - t0 < Q8_TOKENS ? (int)(m - t0) : Q8_TOKENS;
                q8_tile_any(xf + t0 * k, mt, wr, q, scales, bias, n0, k, y + t0 * ldy, ldy);
            }
        }
    }
    free(xf);
    return 0;
}

/* Whether this build has panel.h's GEMMs (q8_rows from Q8_MANY_ROWS, decoder.c's int4
 * products from Q4_PANEL_ROWS): 1 or 0. */
int panel_gemms(void) {
#if defined(PANEL_GEMMS)
    return 1;
#else
    return 0;
#endif
}

/* Whether q8_rows_bf16 rounds x to int8 where asked (AVX-512 VNNI and AVX2 builds); 1
 * or 0. */
int q8_int8_built(void) {
#if defined(Q8_INT8)
    return 1;
#else
    return 0;
#endif
}
