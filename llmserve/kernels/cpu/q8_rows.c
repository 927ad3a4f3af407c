/* Int8 weight-only products of a few rows (a decode step's LM head), streaming the
 * weight once.
 *
 * The weight is QuantizedLinear's int8 layout, which ATen's _weight_int8pack_mm reads:
 * [N, K] int8 codes, row n scaled by scales[n] (bf16): y[m, n] = scales[n] *
 * sum_k x[m, k] q[n, k], rounded to bf16 once. ATen's kernel for one row streams the
 * built-in model's 28 MB LM head at ~9-12 GB/s on two cores, a quarter of a single
 * stream's decode step; this one sign-extends 16 codes to float32 lanes and multiplies
 * them by up to 4 rows of x at once, 4 weight rows at a time (2 and 2 on AVX2), and a
 * second group of rows reads the weight tile again from L1, so the weight streams from
 * memory once. Built into the one
 * library by native.py; declared in kernels.h.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "kernels.h"

/* A tile: Q8_TOKENS rows of x sharing each weight load, Q8_WROWS weight rows at a time,
 * their sums in registers (16 on AVX-512's 32; AVX2's 16 half-width ones hold 4). */
#if defined(__AVX512F__)
#define Q8_TOKENS 4
#define Q8_WROWS 4
#else
#define Q8_TOKENS 2
#define Q8_WROWS 2
#endif
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

static inline float sum16(v16f v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
#endif
}

/* Weight rows [n0, n0 + wr) for tokens [0, m) (m <= Q8_TOKENS, wr <= Q8_WROWS), with m
 * and wr known to the compiler where it inlines. */
static inline __attribute__((always_inline)) void q8_tile(
        const float *xf, int m, int wr, const int8_t *q, const uint16_t *scales,
        const float *bias, int64_t n0, int64_t k, uint16_t *y, int64_t ldy) {
    v16f acc[Q8_TOKENS][Q8_WROWS];
    for (int t = 0; t < m; t++)
        for (int r = 0; r < wr; r++) acc[t][r] = (v16f){0};
    /* Q8_PREFETCH bytes on in the thread's stream, a line per 64 bytes of this tile:
     * the hardware prefetcher alone kept a thread at ~7 GB/s on a Xeon. */
    const uintptr_t ahead = (uintptr_t)(q + n0 * k) + Q8_PREFETCH;  /* may lie past q */
    for (int64_t k0 = 0; k0 < k; k0 += 16) {
        if ((k0 & 63) == 0)
            for (int r = 0; r < wr; r++)
                __builtin_prefetch((const void *)(ahead + (uintptr_t)(r * k + k0)), 0, 3);
        v16f w[Q8_WROWS];
        for (int r = 0; r < wr; r++) w[r] = codes16(q + (n0 + r) * k + k0);
        for (int t = 0; t < m; t++) {
            v16f xv;
            memcpy(&xv, xf + t * k + k0, sizeof xv);
            for (int r = 0; r < wr; r++) acc[t][r] += xv * w[r];
        }
    }
    for (int t = 0; t < m; t++)
        for (int r = 0; r < wr; r++) {
            float v = sum16(acc[t][r]) * bf16_to_f32(scales[n0 + r]);
            if (bias != NULL) v = bf16_to_f32(f32_to_bf16(v)) + bias[n0 + r];
            y[t * ldy + n0 + r] = f32_to_bf16(v);
        }
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

/* y [m, n] = x [m, k] (bf16, rows ldx apart) times the int8 weight, rounded to bf16;
 * bias (float32 [n], or NULL) added to the rounded product and rounded again, as the
 * torch path adds it. k a multiple of 16. Returns 0, -1 out of memory, -2 a shape it
 * does not take. */
int q8_rows_bf16(int num_threads, const uint16_t *x, int64_t m, int64_t ldx, const int8_t *q,
                 const uint16_t *scales, int64_t n, int64_t k, const float *bias, uint16_t *y,
                 int64_t ldy) {
    if (k % 16 || k <= 0 || n <= 0 || m < 0) return -2;
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
