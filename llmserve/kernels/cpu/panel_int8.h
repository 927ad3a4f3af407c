/* int4 products of many rows with x rounded to int8: AVX-512 with VNNI (Ice Lake and
 * Cascade Lake Xeons; Zen 4 too, where they beat gemm.c's quant_gemm at every row
 * count: gemm.rounds_x_to_int8) and AVX2 (Zen 2/3, Haswell to Broadwell). decoder.c's
 * q4_matmul takes them where PANEL_INT8 is built and the caller
 * asks (q4_linear_bf16's int8_x, stack_dims'); q8_rows.c's int8 LM head where
 * PANEL_INT8_VNNI is.
 *
 * panel.h's GEMM multiplies float32: 16 products per FMA (8 on AVX2). VPDPBUSD
 * multiplies 4 unsigned bytes by 4 signed bytes and adds them into each of its 16
 * int32 lanes: 64 products per instruction, and an int4 code is already an unsigned
 * byte. AVX2's VPMADDUBSW multiplies 32 such pairs and adds each two into an int16
 * lane: 32 products per instruction. So, as llama.cpp does for its Q4 x Q8 dot products:
 *   - each row of x is rounded to int8 per group of 32 (the weight's group): codes
 *     c = round(x / d) with d = max|x| / 127, kept with d and d * sum(c) (xq_rows);
 *   - a group's product is then exact in integers, sum_k q_k c_k, and
 *     sum_k w_k d c_k = d (scale sum_k q_k c_k + (zero - 8 scale) sum_k c_k)
 *     (w = (q - 8) scale + zero): the product of the int8-rounded x with the weight.
 * The rounding of x is the only change from the float32 path: per element at most half
 * a step, 1/254 of its group's largest value. Both builds compute the same integers and
 * the same float32 operations in the same order: their results are bit-identical.
 *
 * A panel is the columns of one half of an int4 block (panel.h's: 32 on AVX-512, 16 on
 * AVX2), over a chunk of k, as bytes [k / 4][PANEL8_COLS][4]: the codes of 4
 * consecutive k of a column side by side, one int32 lane (q4_panel_u8 rearranges
 * ATen's pack into it). Rows of x go PANEL8_GROUP at a time.
 */
#ifndef LLMSERVE_PANEL_INT8_H
#define LLMSERVE_PANEL_INT8_H

#include <stdint.h>
#include <string.h>
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANEL_INT8 1
#define PANEL_INT8_VNNI 1  /* VPDPBUSD: also the int8 LM head (q8_rows.c) */
#define PANEL8_COLS 32
#define PANEL8_GROUP 6
#elif defined(AVX2_ONLY)
/* An int8 weight's codes (+ 128) by VPMADDUBSW would overflow its int16 sums (2 x 255
 * x 127), and the sign trick llama.cpp uses costs as many instructions as the float32
 * FMAs it would replace. So an int8 weight (the LM head) goes as two int4 ones: code +
 * 128 = 16 high + low, each nibble through the int4 products, their group sums
 * 16 dot_high + dot_low (panel8_group_q8): twice the int4 product's work per weight,
 * still 1.5x fewer instructions than float32 FMAs. */
#define PANEL_INT8 1
#define PANEL8_COLS 16
#define PANEL8_GROUP 4  /* 8 int16 sums: 6 rows' 12 leave no register for constants */
#endif

#if defined(PANEL_INT8)
#include <immintrin.h>

#define PANEL8_CHUNK 256  /* k a panel holds: 8 KB (4 on AVX2), in L1 while every row reads it */
#define PANEL8_Q 32       /* the weight's group along k: one scale per 32 values */

/* 4 registers of codes, r[i] the bytes of row k + i of the pack (per 128-bit lane: on
 * AVX-512, columns 0-15 | 16-31 of one quad of k; on AVX2, columns 0-15 of quad k |
 * quad k + 1), stored as 128 bytes of column quads: each column's 4 codes one int32,
 * the columns in order. Byte and word unpacks interleave within lanes (quads of columns
 * 0-3, 4-7, 8-11, 12-15 of each lane); the permutes put the lanes back in order. */
static inline __attribute__((always_inline)) void quads_store(const __m256i r[4],
                                                              uint8_t *panel) {
    const __m256i a = _mm256_unpacklo_epi8(r[0], r[1]), b = _mm256_unpackhi_epi8(r[0], r[1]);
    const __m256i c = _mm256_unpacklo_epi8(r[2], r[3]), d = _mm256_unpackhi_epi8(r[2], r[3]);
    const __m256i e0 = _mm256_unpacklo_epi16(a, c), e1 = _mm256_unpackhi_epi16(a, c);
    const __m256i e2 = _mm256_unpacklo_epi16(b, d), e3 = _mm256_unpackhi_epi16(b, d);
    _mm256_storeu_si256((__m256i *)panel, _mm256_permute2x128_si256(e0, e1, 0x20));
    _mm256_storeu_si256((__m256i *)(panel + 32), _mm256_permute2x128_si256(e2, e3, 0x20));
    _mm256_storeu_si256((__m256i *)(panel + 64), _mm256_permute2x128_si256(e0, e1, 0x31));
    _mm256_storeu_si256((__m256i *)(panel + 96), _mm256_permute2x128_si256(e2, e3, 0x31));
}

#if defined(PANEL_INT8_VNNI)
/* Row t of x [M, K] (bf16, rows ldx apart) as int8 codes (codes [M, K]), with per
 * group g of 32 its step d (step[t * G + g]) and d * sum(codes) (csum): d = max|x| /
 * 127 (0 for a group of zeros), code = x * (1 / d) rounded to nearest even. */
static inline void xq_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int8_t *codes,
                    float *step, float *csum) {
    const int64_t groups = K / PANEL8_Q;
    for (int64_t t = 0; t < M; t++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = t * K + g * PANEL8_Q;
            const uint16_t *xg = x + t * ldx + g * PANEL8_Q;
            const __m512 lo = (__m512)load16_bf16(xg), hi = (__m512)load16_bf16(xg + 16);
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            const __m512i c_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            const __m512i c_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(codes + at), _mm512_cvtsepi32_epi8(c_lo));
            _mm_storeu_si128((__m128i *)(codes + at + 16), _mm512_cvtsepi32_epi8(c_hi));
            step[t * groups + g] = d;
            csum[t * groups + g] = d * (float)_mm512_reduce_add_epi32(
                _mm512_add_epi32(c_lo, c_hi));
        }
}

/* panel [(k1 - k0) / 4][32][4] = the int4 codes of 32 columns over k in [k0, k1)
 * (multiples of 4): rows k..k+3 of the pack (32 bytes each, `rows` 32 bytes apart), low
 * nibbles (high 0) or high ones, transposed so that each column's 4 codes are one
 * int32. Byte unpacks interleave within 128-bit lanes, so the last step puts the
 * column quads back in order. */
static inline void q4_panel_u8(const uint8_t *rows, int high, int64_t k0, int64_t k1,
                               uint8_t *panel) {
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int64_t k = k0; k < k1; k += 4, panel += 4 * PANEL8_COLS) {
        __m256i r[4];
        for (int i = 0; i < 4; i++) {
            r[i] = _mm256_loadu_si256((const __m256i *)(rows + (k + i) * PANEL8_COLS));
            r[i] = _mm256_and_si256(high ? _mm256_srli_epi16(r[i], 4) : r[i], low4);
        }
        quads_store(r, panel);
    }
}

/* sums [m, PANEL8_COLS] (+)= rows [0, m) of x (codes rows K apart; their steps and code sums
 * rows `groups` apart) times the panel over k in [k0, k1) (multiples of 32; the sums
 * start from zero where k0 is 0). sz: for an int4 panel, its first (scale, zero) pair
 * of group 0 (bf16 words, groups N pairs apart), and each group's sum is
 * d (scale dot + (zero - 8 scale) sum(codes)); NULL for an int8 panel (codes + 128,
 * see q8_rows.c), whose weight scales come after: each group adds d dot. The m <= 6
 * rows' 2 int32 sums of a group and 2 float32 running sums each: 24 of the 32 registers. */
static inline __attribute__((always_inline)) void panel8_group(
        const int8_t *codes, const float *step, const float *csum, int64_t K, int64_t groups,
        int m, const uint8_t *panel, const uint16_t *sz, int64_t N, int64_t k0, int64_t k1,
        float *sums) {
    __m512 acc[PANEL8_GROUP][2];
    for (int t = 0; t < m; t++)
        for (int v = 0; v < 2; v++)
            acc[t][v] = k0 > 0 ? _mm512_loadu_ps(sums + t * PANEL8_COLS + 16 * v)
                               : _mm512_setzero_ps();
    for (int64_t g = k0 / PANEL8_Q; g < k1 / PANEL8_Q; g++) {
        __m512i dot[PANEL8_GROUP][2];
        for (int t = 0; t < m; t++)
            for (int v = 0; v < 2; v++) dot[t][v] = _mm512_setzero_si512();
        const uint8_t *p = panel + (g * PANEL8_Q - k0) * PANEL8_COLS;
        for (int quad = 0; quad < PANEL8_Q / 4; quad++, p += 4 * PANEL8_COLS) {
            const __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 64);
            for (int t = 0; t < m; t++) {
                int32_t four;
                memcpy(&four, codes + t * K + g * PANEL8_Q + 4 * quad, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                dot[t][0] = _mm512_dpbusd_epi32(dot[t][0], w0, xb);
                dot[t][1] = _mm512_dpbusd_epi32(dot[t][1], w1, xb);
            }
        }
        if (sz == NULL) {  /* int8 weight */
            for (int t = 0; t < m; t++) {
                const __m512 d = _mm512_set1_ps(step[t * groups + g]);
                for (int v = 0; v < 2; v++)
                    acc[t][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][v]), d, acc[t][v]);
            }
            continue;
        }
        __m512 scale[2], offset[2];  /* (scale, zero) bf16 pairs as words: see q4_pass */
        for (int v = 0; v < 2; v++) {
            const __m512i pair = _mm512_loadu_si512(sz + (g * N + 16 * v) * 2);
            scale[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
            const __m512 zero = _mm512_castsi512_ps(
                _mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
            offset[v] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale[v], zero);
        }
        for (int t = 0; t < m; t++) {
            const __m512 d = _mm512_set1_ps(step[t * groups + g]);
            const __m512 cs = _mm512_set1_ps(csum[t * groups + g]);
            for (int v = 0; v < 2; v++)
                acc[t][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][v]),
                                            _mm512_mul_ps(scale[v], d),
                                            _mm512_fmadd_ps(offset[v], cs, acc[t][v]));
        }
    }
    for (int t = 0; t < m; t++)
        for (int v = 0; v < 2; v++) _mm512_storeu_ps(sums + t * PANEL8_COLS + 16 * v, acc[t][v]);
}

#else  /* AVX2 */

/* xq_rows (above) in 8-lane registers: the same codes, steps and code sums. */
static inline void xq_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int8_t *codes,
                    float *step, float *csum) {
    const int64_t groups = K / PANEL8_Q;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    /* packs leave 4-byte runs in the order 0, 2, 4, 6, 1, 3, 5, 7 of the group */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t t = 0; t < M; t++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = t * K + g * PANEL8_Q;
            const uint16_t *xg = x + t * ldx + g * PANEL8_Q;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = load8_bf16(xg + 8 * i);
            __m256 big = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                                     _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                                     _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            const float amax = _mm_cvtss_f32(m4);
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            __m256i c[4];
            for (int i = 0; i < 4; i++)
                c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                                     _mm256_packs_epi32(c[2], c[3]));
            _mm256_storeu_si256((__m256i *)(codes + at),
                                _mm256_permutevar8x32_epi32(bytes, order));
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]),
                                                   _mm256_add_epi32(c[2], c[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total),
                                       _mm256_extracti128_si256(total, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            step[t * groups + g] = d;
            csum[t * groups + g] = d * (float)_mm_cvtsi128_si32(s4);
        }
}

/* panel [(k1 - k0) / 4][16][4]: q4_panel_u8 (above) for ATen's AVX2 pack, whose rows
 * are 16 bytes (a block's 32 columns, the second 16 in the high nibbles). Two quads of
 * k at a time, one per 128-bit lane: rows k..k+3 in the low lanes, k+4..k+7 in the
 * high ones. */
static inline void q4_panel_u8(const uint8_t *rows, int high, int64_t k0, int64_t k1,
                               uint8_t *panel) {
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int64_t k = k0; k < k1; k += 8, panel += 8 * PANEL8_COLS) {
        __m256i r[4];
        for (int i = 0; i < 4; i++) {
            r[i] = _mm256_inserti128_si256(
                _mm256_castsi128_si256(
                    _mm_loadu_si128((const __m128i *)(rows + (k + i) * PANEL8_COLS))),
                _mm_loadu_si128((const __m128i *)(rows + (k + 4 + i) * PANEL8_COLS)), 1);
            r[i] = _mm256_and_si256(high ? _mm256_srli_epi16(r[i], 4) : r[i], low4);
        }
        quads_store(r, panel);
    }
}

/* One row's products with a quad of k of a 16-column panel (w0: columns 0-7, w1: 8-15),
 * added to its two int16 sums. x: the row's 4 codes of the quad. */
static inline __attribute__((always_inline)) void panel8_quad_row(
        __m256i w0, __m256i w1, const int8_t *x, __m256i *lo, __m256i *hi) {
    int32_t four;
    memcpy(&four, x, sizeof four);
    const __m256i xb = _mm256_set1_epi32(four);
    *lo = _mm256_add_epi16(*lo, _mm256_maddubs_epi16(w0, xb));
    *hi = _mm256_add_epi16(*hi, _mm256_maddubs_epi16(w1, xb));
}

/* A group's 8 quads of k for 4 rows (panel8_quad_row each), in assembly: compiled
 * from C, GCC kept a copy of the sums in memory as well, a store and a register copy
 * per product pair, and reloaded the row pointers from the stack (its register
 * allocator, in the OpenMP body, with the scaling's values live). Here the 8 sums stay
 * in registers; ymm12-15 hold the panel's two registers, the broadcast and a product.
 * The first quad's products are the sums' first values (the sums are set, not added
 * to): 8 of the group's 128 additions saved. */
static inline __attribute__((always_inline)) void panel8_quads4(
        const uint8_t *p, const int8_t *x0, const int8_t *x1, const int8_t *x2,
        const int8_t *x3, __m256i *lo0, __m256i *hi0, __m256i *lo1, __m256i *hi1,
        __m256i *lo2, __m256i *hi2, __m256i *lo3, __m256i *hi3) {
    const uint8_t *end = p + PANEL8_Q * PANEL8_COLS;
    int64_t i = 4;  /* the quad's first k in the group, for every row (after the first) */
#define PANEL8_ROW_FIRST_ASM(X, LO, HI)                             \
        "vpbroadcastd (%[" X "]), %%ymm14\n\t"                      \
        "vpmaddubsw %%ymm14, %%ymm12, %[" LO "]\n\t"                \
        "vpmaddubsw %%ymm14, %%ymm13, %[" HI "]\n\t"
#define PANEL8_ROW_ASM(X, LO, HI)                                   \
        "vpbroadcastd (%[" X "],%[i]), %%ymm14\n\t"                 \
        "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"                  \
        "vpaddw %%ymm15, %[" LO "], %[" LO "]\n\t"                  \
        "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"                  \
        "vpaddw %%ymm15, %[" HI "], %[" HI "]\n\t"
    __asm__(
        "vmovdqu (%[p]), %%ymm12\n\t"
        "vmovdqu 32(%[p]), %%ymm13\n\t"
        PANEL8_ROW_FIRST_ASM("x0", "lo0", "hi0")
        PANEL8_ROW_FIRST_ASM("x1", "lo1", "hi1")
        PANEL8_ROW_FIRST_ASM("x2", "lo2", "hi2")
        PANEL8_ROW_FIRST_ASM("x3", "lo3", "hi3")
        "add $64, %[p]\n\t"
        "1:\n\t"
        "vmovdqu (%[p]), %%ymm12\n\t"
        "vmovdqu 32(%[p]), %%ymm13\n\t"
        PANEL8_ROW_ASM("x0", "lo0", "hi0")
        PANEL8_ROW_ASM("x1", "lo1", "hi1")
        PANEL8_ROW_ASM("x2", "lo2", "hi2")
        PANEL8_ROW_ASM("x3", "lo3", "hi3")
        "add $64, %[p]\n\t"
        "add $4, %[i]\n\t"
        "cmp %[end], %[p]\n\t"
        "jne 1b\n\t"
        : [lo0] "=&x"(*lo0), [hi0] "=&x"(*hi0), [lo1] "=&x"(*lo1), [hi1] "=&x"(*hi1),
          [lo2] "=&x"(*lo2), [hi2] "=&x"(*hi2), [lo3] "=&x"(*lo3), [hi3] "=&x"(*hi3),
          [p] "+r"(p), [i] "+r"(i)
        : [end] "r"(end), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3)
        : "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
#undef PANEL8_ROW_ASM
#undef PANEL8_ROW_FIRST_ASM
}

/* A group's int16 sums of one row (lo: columns 0-7, hi: 8-15) into its float32
 * running sums: acc += d (scale dot + (zero - 8 scale) sum(codes)), as the VNNI build
 * computes it. */
static inline __attribute__((always_inline)) void panel8_scale_row(
        __m256i lo, __m256i hi, float d, float cs, const __m256 scale[2],
        const __m256 offset[2], float *acc) {
    const __m256 dv = _mm256_set1_ps(d), csv = _mm256_set1_ps(cs);
    const __m256i dot[2] = {lo, hi};
    for (int v = 0; v < 2; v++) {
        const __m256i dot32 = _mm256_madd_epi16(dot[v], _mm256_set1_epi16(1));
        _mm256_storeu_ps(acc + 8 * v, _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(dot32), _mm256_mul_ps(scale[v], dv),
            _mm256_fmadd_ps(offset[v], csv, _mm256_loadu_ps(acc + 8 * v))));
    }
}

/* A group's int16 sums of m <= 4 rows (x0..: the rows' codes of the group; the sums
 * start from zero) with a 16-column panel's 8 quads of k from p (lo: columns 0-7, hi:
 * 8-15): each quad adds
 * two int16 sums of two products per column (at most 2 x 15 x 127), and a group's 8
 * quads fit int16 (30,480). 4 rows take panel8_quads4's assembly; fewer (a tail) this
 * loop in C. */
static inline __attribute__((always_inline)) void panel8_nibble_sums(
        const uint8_t *p, int m, const int8_t *x0, const int8_t *x1, const int8_t *x2,
        const int8_t *x3, __m256i *lo0, __m256i *hi0, __m256i *lo1, __m256i *hi1,
        __m256i *lo2, __m256i *hi2, __m256i *lo3, __m256i *hi3) {
    if (m == 4) {
        panel8_quads4(p, x0, x1, x2, x3, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3);
        return;
    }
    /* not unrolled: GCC would then sum the products as a tree, out of registers */
    _Pragma("GCC unroll 1")
    for (int quad = 0; quad < PANEL8_Q / 4; quad++, p += 4 * PANEL8_COLS) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)p);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        panel8_quad_row(w0, w1, x0 + 4 * quad, lo0, hi0);
        if (m > 1) panel8_quad_row(w0, w1, x1 + 4 * quad, lo1, hi1);
        if (m > 2) panel8_quad_row(w0, w1, x2 + 4 * quad, lo2, hi2);
    }
}

/* panel8_group (above) for an int4 panel of 16 columns, by VPMADDUBSW
 * (panel8_nibble_sums), each group's int16 sums summed into int32 once (VPMADDWD by
 * ones). The 4 rows' int16 sums, the panel's 2 registers, the broadcast and a product
 * take 12 of the 16 registers: the float32 running sums stay in `sums` (in L1), read
 * and written once per group. */
static inline __attribute__((always_inline)) void panel8_group(
        const int8_t *codes, const float *step, const float *csum, int64_t K, int64_t groups,
        int m, const uint8_t *panel, const uint16_t *sz, int64_t N, int64_t k0, int64_t k1,
        float *sums) {
    if (k0 == 0) memset(sums, 0, sizeof(float) * (size_t)m * PANEL8_COLS);
    for (int64_t g = k0 / PANEL8_Q; g < k1 / PANEL8_Q; g++) {
        __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
        __m256i lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
        const int8_t *x0 = codes + g * PANEL8_Q, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
        panel8_nibble_sums(panel + (g * PANEL8_Q - k0) * PANEL8_COLS, m, x0, x1, x2, x3,
                           &lo0, &hi0, &lo1, &hi1, &lo2, &hi2, &lo3, &hi3);
        __m256 scale[2], offset[2];
        for (int v = 0; v < 2; v++) {
            __m256 zero;
            bf16_halves8(_mm256_loadu_si256((const __m256i *)(sz + (g * N + 8 * v) * 2)),
                         &scale[v], &zero);
            offset[v] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale[v], zero);
        }
        const float *d = step + g, *cs = csum + g;
        panel8_scale_row(lo0, hi0, d[0], cs[0], scale, offset, sums);
        if (m > 1) panel8_scale_row(lo1, hi1, d[groups], cs[groups], scale, offset,
                                    sums + PANEL8_COLS);
        if (m > 2) panel8_scale_row(lo2, hi2, d[2 * groups], cs[2 * groups], scale, offset,
                                    sums + 2 * PANEL8_COLS);
        if (m > 3) panel8_scale_row(lo3, hi3, d[3 * groups], cs[3 * groups], scale, offset,
                                    sums + 3 * PANEL8_COLS);
        /* The sums live in memory: GCC would otherwise keep them in registers across
         * groups and spill the int16 sums of the loop above instead (measured 3x slower). */
        __asm__ __volatile__("" ::: "memory");
    }
}

/* A group's int32 sums 16 dot_high + dot_low of one row (VPMADDWD by 16 and by ones)
 * into its float32 running sums: acc += d dot, as the VNNI build's int8 panels do. */
static inline __attribute__((always_inline)) void panel8_q8_scale_row(
        __m256i lo_high, __m256i hi_high, __m256i lo_low, __m256i hi_low, float d,
        float *acc) {
    const __m256 dv = _mm256_set1_ps(d);
    const __m256i high[2] = {lo_high, hi_high}, low[2] = {lo_low, hi_low};
    for (int v = 0; v < 2; v++) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(high[v], _mm256_set1_epi16(16)),
                                             _mm256_madd_epi16(low[v], _mm256_set1_epi16(1)));
        _mm256_storeu_ps(acc + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dv,
                                                      _mm256_loadu_ps(acc + 8 * v)));
    }
}

/* panel8_group for an int8 weight of 16 columns on AVX2: its codes + 128 as two int4
 * panels, the high nibbles at `panel` and the low ones PANEL8_CHUNK * PANEL8_COLS bytes
 * on (q8_rows.c's q8_panel_nibbles). Each group's int32 sum is exactly the VNNI build's
 * VPDPBUSD sum of the codes + 128 (the shift of 128 is the caller's, as there). */
static inline __attribute__((always_inline)) void panel8_group_q8(
        const int8_t *codes, const float *step, int64_t K, int64_t groups, int m,
        const uint8_t *panel, int64_t k0, int64_t k1, float *sums) {
    if (k0 == 0) memset(sums, 0, sizeof(float) * (size_t)m * PANEL8_COLS);
    for (int64_t g = k0 / PANEL8_Q; g < k1 / PANEL8_Q; g++) {
        const int8_t *x0 = codes + g * PANEL8_Q, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
        const uint8_t *p = panel + (g * PANEL8_Q - k0) * PANEL8_COLS;
        __m256i h[8], lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
        __m256i lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
        panel8_nibble_sums(p, m, x0, x1, x2, x3, &lo0, &hi0, &lo1, &hi1, &lo2, &hi2, &lo3,
                           &hi3);
        h[0] = lo0, h[1] = hi0, h[2] = lo1, h[3] = hi1, h[4] = lo2, h[5] = hi2, h[6] = lo3;
        h[7] = hi3;
        lo0 = hi0 = lo1 = hi1 = lo2 = hi2 = lo3 = hi3 = _mm256_setzero_si256();
        panel8_nibble_sums(p + PANEL8_CHUNK * PANEL8_COLS, m, x0, x1, x2, x3, &lo0, &hi0,
                           &lo1, &hi1, &lo2, &hi2, &lo3, &hi3);
        const float *d = step + g;
        panel8_q8_scale_row(h[0], h[1], lo0, hi0, d[0], sums);
        if (m > 1) panel8_q8_scale_row(h[2], h[3], lo1, hi1, d[groups], sums + PANEL8_COLS);
        if (m > 2) panel8_q8_scale_row(h[4], h[5], lo2, hi2, d[2 * groups],
                                       sums + 2 * PANEL8_COLS);
        if (m > 3) panel8_q8_scale_row(h[6], h[7], lo3, hi3, d[3 * groups],
                                       sums + 3 * PANEL8_COLS);
        __asm__ __volatile__("" ::: "memory");  /* as in panel8_group */
    }
}
#endif

/* Share `share` of `shares` of xq_rows's rows (each thread of a product quantises its
 * part of x, then waits for the others at a barrier: done by one thread, it left the
 * others idle, ~3% of a 32-stream run on AVX2). */
static inline void xq_rows_share(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                                 int8_t *codes, float *step, float *csum, int share,
                                 int shares) {
    const int64_t first = M * share / shares, last = M * (share + 1) / shares;
    const int64_t groups = K / PANEL8_Q;
    xq_rows(x + first * ldx, ldx, last - first, K, codes + first * K, step + first * groups,
            csum + first * groups);
}

/* All m rows (any number), PANEL8_GROUP at a time with the group's size known to the
 * compiler; sums [m, PANEL8_COLS]. Inlined, so that sz's NULL (int8) or not is known too. */
static inline __attribute__((always_inline)) void panel8_rows(const int8_t *codes, const float *step, const float *csum,
                               int64_t K, int64_t m, const uint8_t *panel, const uint16_t *sz,
                               int64_t N, int64_t k0, int64_t k1, float *sums) {
    const int64_t groups = K / PANEL8_Q;
#define PANEL8_CASE(M_)                                                                     \
    case M_:                                                                                \
        panel8_group(codes + t0 * K, step + t0 * groups, csum + t0 * groups, K, groups, M_, \
                     panel, sz, N, k0, k1, sums + t0 * PANEL8_COLS);                        \
        break;
    for (int64_t t0 = 0; t0 < m; t0 += PANEL8_GROUP) {
        switch (m - t0 < PANEL8_GROUP ? (int)(m - t0) : PANEL8_GROUP) {
            PANEL8_CASE(1) PANEL8_CASE(2) PANEL8_CASE(3) PANEL8_CASE(4)
#if PANEL8_GROUP == 6
            PANEL8_CASE(5) PANEL8_CASE(6)
#endif
        }
    }
#undef PANEL8_CASE
}

#if defined(AVX2_ONLY)
/* panel8_rows for an int8 weight's two nibble panels (panel8_group_q8). */
static inline __attribute__((always_inline)) void panel8_rows_q8(
        const int8_t *codes, const float *step, int64_t K, int64_t m, const uint8_t *panel,
        int64_t k0, int64_t k1, float *sums) {
    const int64_t groups = K / PANEL8_Q;
#define PANEL8_CASE(M_)                                                                  \
    case M_:                                                                             \
        panel8_group_q8(codes + t0 * K, step + t0 * groups, K, groups, M_, panel, k0, k1, \
                        sums + t0 * PANEL8_COLS);                                        \
        break;
    for (int64_t t0 = 0; t0 < m; t0 += PANEL8_GROUP) {
        switch (m - t0 < PANEL8_GROUP ? (int)(m - t0) : PANEL8_GROUP) {
            PANEL8_CASE(1) PANEL8_CASE(2) PANEL8_CASE(3) PANEL8_CASE(4)
        }
    }
#undef PANEL8_CASE
}
#endif
#endif

#endif
