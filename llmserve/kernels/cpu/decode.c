/* Paged-attention decode on CPUs: one new query token per sequence, attending over
 * its whole context in the paged KV cache.
 *
 * Each (sequence, KV head) task reads that head's K and V rows of every block once,
 * for the whole GQA group of query heads sharing it, straight from the cache: no
 * gathered or padded copy of the context, no mask. Scores, softmax and accumulation
 * are float32 whatever the cache dtype (float32 or bfloat16).
 *
 * Layer cache layout: [2 (K, V), num_blocks, block_size, kv_heads, head_dim].
 * Built and loaded by native.py (compiled for the machine it runs on).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "kernels.h"

static inline __attribute__((always_inline)) void load_row(const void *base, int64_t offset, int dtype, int n, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

/* exp(x) for x <= 0 (scores minus their maximum), vectorisable: 2^n * p(r) with
 * x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial: relative error about
 * 1e-7 (the reassociation the build allows may fold the two-part ln2 reduction, which
 * matters only for weights far below anything that moves the sum). */
static void exp_inplace(float *x, int n) {
    for (int i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float k = __builtin_roundf(v * 1.44269504088896341f);
        float r = v - k * 0.693145751953125f - k * 1.428606765330187e-06f;
        float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f
                  + r * (0.008333334f + r * 0.0013888889f)))));
        int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        x[i] = p * scale;
    }
}

/* Gemma 2's logit soft-capping of n scores in place: cap * tanh(s / cap) (cap <= 0:
 * none). Before the maximum is taken: the cap bounds what the softmax sees. */
static void softcap_scores(float *s, int n, float cap) {
    if (cap <= 0.0f) return;
    const float inv = 1.0f / cap;
    for (int t = 0; t < n; t++) s[t] = cap * tanhf(s[t] * inv);
}

/* One head's softmax in place over n scores whose maximum is m. sink (NULL: none):
 * gpt-oss's learned logit, which joins the maximum and the denominator but owns no
 * value row, so the weights sum to less than one. */
static void normalise(float *sg, int n, float m, const float *sink) {
    if (sink != NULL && *sink > m) m = *sink;
    for (int t = 0; t < n; t++) sg[t] -= m;
    exp_inplace(sg, n);
    float sum = 0.0f;
    for (int t = 0; t < n; t++) sum += sg[t];
    if (sink != NULL) sum += expf(*sink - m);
    float inv = 1.0f / sum;
    for (int t = 0; t < n; t++) sg[t] *= inv;
}

/* One (sequence, KV head) task. Inlined into callers with a constant head_dim and
 * dtype, so that the compiler unrolls and vectorises the head_dim loops fully. */
static inline __attribute__((always_inline)) void attend_one(
        const void *q, int64_t q_stride, void *out, const void *kv, int64_t q_row,
        const int32_t *table, int first, int seq_len, int64_t v_offset, int block_size,
        int num_heads, int kv_heads, const int head_dim, int kv_head, float scale,
        const float *sinks, float softcap, const int dtype, float *scratch) {
    const int group = num_heads / kv_heads;
    float *qf = scratch;                                 /* [group, head_dim] */
    float *acc = qf + group * head_dim;                  /* [group, head_dim] */
    float *row = acc + group * head_dim;                 /* [head_dim] */
    float *scores = row + head_dim;                      /* [group, seq_len] */
    const int64_t token_stride = (int64_t)kv_heads * head_dim;
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int g = 0; g < group; g++) {
        int64_t off = q_row * q_stride + ((int64_t)kv_head * group + g) * head_dim;
        load_row(q, off, dtype, head_dim, qf + g * head_dim);
        for (int d = 0; d < head_dim; d++) qf[g * head_dim + d] *= scale;
    }
    /* Scores: each K row read once for the whole group (keys [first, seq_len): a
     * sliding window's; scores indexed by position). */
    for (int b = first / block_size; b < num_blocks; b++) {
        int64_t base = (int64_t)table[b] * block_size * token_stride
                       + (int64_t)kv_head * head_dim;
        int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        for (int j = b == first / block_size ? first % block_size : 0; j < n; j++) {
            load_row(kv, base + j * token_stride, dtype, head_dim, row);
            for (int g = 0; g < group; g++) {
                const float *qg = qf + g * head_dim;
                float s = 0.0f;
                for (int d = 0; d < head_dim; d++) s += qg[d] * row[d];
                scores[(int64_t)g * seq_len + b * block_size + j] = s;
            }
        }
    }
    /* Softmax per query head. */
    for (int g = 0; g < group; g++) {
        float *sg = scores + (int64_t)g * seq_len + first;
        const int n = seq_len - first;
        softcap_scores(sg, n, softcap);
        float m = sg[0];
        for (int t = 1; t < n; t++) m = sg[t] > m ? sg[t] : m;
        normalise(sg, n, m, sinks != NULL ? sinks + kv_head * group + g : NULL);
    }
    /* Weighted sum of V rows, each read once for the group. */
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int b = first / block_size; b < num_blocks; b++) {
        int64_t base = v_offset + (int64_t)table[b] * block_size * token_stride
                       + (int64_t)kv_head * head_dim;
        int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        for (int j = b == first / block_size ? first % block_size : 0; j < n; j++) {
            load_row(kv, base + j * token_stride, dtype, head_dim, row);
            for (int g = 0; g < group; g++) {
                float p = scores[(int64_t)g * seq_len + b * block_size + j];
                float *ag = acc + g * head_dim;
                for (int d = 0; d < head_dim; d++) ag[d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        int64_t off = (q_row * num_heads + (int64_t)kv_head * group + g) * head_dim;
        if (dtype == DTYPE_BF16) {
            uint16_t *dst = (uint16_t *)out + off;
            for (int d = 0; d < head_dim; d++) dst[d] = f32_to_bf16(acc[g * head_dim + d]);
        } else {
            memcpy((float *)out + off, acc + g * head_dim, sizeof(float) * head_dim);
        }
    }
}

/* ---- The fast path (attend_tiled): head_dim 64 or 128, GQA group 1..8. Scores a
 * tile of 16 keys at a time, their 16 dot products reduced together (8 and 8 on AVX2);
 * K and V rows widened from bf16 straight into registers; the group's accumulators in
 * registers (group and head_dim compile-time constants in the value pass; on AVX2,
 * the group, 16 values of head_dim a pass). ---- */

#define TILE 16     /* keys whose scores are reduced together */
#define MAX_GROUP 8 /* the largest GQA group specialised */
#define MAX_VECS 8  /* head_dim / 16 for head_dim 128 */
#define PREFETCH_AHEAD 16 /* V rows asked for ahead of their use */

/* 32 consecutive cache values as two float vectors, in "pair order": for bf16, the
 * even elements then the odd ones (a 32-bit word holds two bf16, and a bf16 is the
 * top half of a float, so one shift or one mask widens 16 of them, straight into a
 * register); for float32, elements 0-15 then 16-31. q and the accumulators are kept in
 * the same order, so dot products and weighted sums never reorder anything: only q's
 * load and the output store do (pair_pos). */
static inline __attribute__((always_inline)) void load_pair(const void *base, int64_t off,
                                                            const int dtype, v16f *lo,
                                                            v16f *hi) {
    if (dtype == DTYPE_BF16) {
        v16u32 w;
        memcpy(&w, (const uint16_t *)base + off, sizeof w);
        *lo = (v16f)(w << 16);
        *hi = (v16f)(w & 0xFFFF0000u);
    } else {
        memcpy(lo, (const float *)base + off, sizeof *lo);
        memcpy(hi, (const float *)base + off + 16, sizeof *hi);
    }
}

/* Where element d of a row sits in pair order. */
static inline int pair_pos(int d, int dtype) {
    int r = d % 32;
    return d - r + (dtype == DTYPE_BF16 ? (r & 1) * 16 + r / 2 : r);
}

/* Half of lanes of a and half of b, summed: the step of a transpose-and-add tree.
 * With a's and b's lanes in chunks of 2w, chunk c of the result holds w lanes from
 * a's chunk c (the sum of its two halves) then w from b's. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  /* GCC before 12 has only its own builtin, with the indices as a vector */
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif
#define FOLD8(a, b) (SHUFFLE16(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) \
                     + SHUFFLE16(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define FOLD4(a, b) (SHUFFLE16(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) \
                     + SHUFFLE16(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
#define FOLD2(a, b) (SHUFFLE16(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) \
                     + SHUFFLE16(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define FOLD1(a, b) (SHUFFLE16(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) \
                     + SHUFFLE16(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))

/* Lane j of the result: the sum of x[j]'s lanes. 15 folds instead of 16 horizontal
 * sums; pairing j with j + 8, then + 4, + 2, + 1 leaves the keys in order. */
static inline __attribute__((always_inline)) v16f sum_lanes16(const v16f x[TILE]) {
    v16f a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) a[j] = FOLD8(x[j], x[j + 8]);
    for (int j = 0; j < 4; j++) b[j] = FOLD4(a[j], a[j + 4]);
    for (int j = 0; j < 2; j++) c[j] = FOLD2(b[j], b[j + 2]);
    return FOLD1(c[0], c[1]);
}

/* The scores of one query head (q in pair order, pre-scaled) against a tile of keys
 * (row offsets into the cache; past the context, repeats of the last key). */
static inline __attribute__((always_inline)) v16f tile_scores(
        const void *kv, const int64_t *off, const v16f *qg, const int head_dim,
        const int dtype) {
    v16f dots[TILE];
    for (int j = 0; j < TILE; j++) {
        v16f s = {0};
        for (int c = 0; c < head_dim / 32; c++) {
            v16f lo, hi;
            load_pair(kv, off[j] + 32 * c, dtype, &lo, &hi);
            s += qg[2 * c] * lo + qg[2 * c + 1] * hi;
        }
        dots[j] = s;
    }
    return sum_lanes16(dots);
}

/* Row offsets of the K rows of keys [first, seq_len) (all of the context, or a sliding
 * window's end of it), in token order from off[0], padded to whole tiles with the last
 * one (so tiles never branch on their length): block lookups done once, for both the
 * K and the V pass. A block at a time: a division per key (the block size is not a
 * constant here) was two thirds of a decode's attend() outside its passes. */
static int64_t *key_offsets(int64_t *off, const int32_t *table, int first, int seq_len,
                            int block_size, int64_t token_stride, int64_t head_off) {
    int i = 0;
    for (int t = first; t < seq_len;) {
        const int b = t / block_size;
        const int end = (b + 1) * block_size < seq_len ? (b + 1) * block_size : seq_len;
        const int64_t shift = ((int64_t)table[b] - b) * block_size;  /* t's row: shift + t */
        for (; t < end; t++, i++) off[i] = (shift + t) * token_stride + head_off;
    }
    for (const int n = i; i % TILE; i++) off[i] = off[n - 1];
    return off;
}

/* Asks for the cache lines of rows off[0..n) ahead of their use: a context's rows are
 * scattered over blocks, one head's slice of each token, which the hardware
 * prefetchers follow poorly, and the kernel would otherwise wait on every miss. */
static inline __attribute__((always_inline)) void prefetch_rows(
        const void *kv, int64_t shift, const int64_t *off, int n, const int head_dim,
        const int dtype) {
    const int bytes = head_dim * (dtype == DTYPE_BF16 ? 2 : 4);
    for (int j = 0; j < n; j++) {
        const char *row = (const char *)kv + (shift + off[j]) * (bytes / head_dim);
        for (int b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
    }
}

/* The prefetches of the scores pass, a tile ahead: this head's K rows into L1; with
 * row_bytes > 0 (the first head of a sequence whose other heads the same thread
 * takes next), also the whole token rows of K and V, every head's, into L2. A block
 * holds its tokens' heads side by side, so whole rows are contiguous reads, where
 * one head's slices are short pieces scattered across them (measured: ~20% faster
 * past the L3, where the engine's caches live). */
static inline __attribute__((always_inline)) void prefetch_tile(
        const void *kv, const int64_t *off, int64_t v_offset, int row_bytes,
        const int head_dim, const int dtype) {
    prefetch_rows(kv, 0, off, TILE, head_dim, dtype);
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    for (int j = 0; j < TILE && row_bytes > 0; j++) {
        const char *k = (const char *)kv + off[j] * elem, *v = k + v_offset * elem;
        for (int b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 2);
            __builtin_prefetch(v + b, 0, 2);
        }
    }
}

/* The largest of x[0..n), n a multiple of 16: 16 running maxima (the compiler keeps a
 * scalar `m = x > m ? x : m` loop scalar, as it may not reorder it around NaNs). */
static float max16(const float *x, int n) {
#if defined(AVX2_ONLY)
    /* VMAXPS(v, m) is the select below (a NaN v keeps m), which GCC compiled lane by
     * lane for AVX2's two registers of 8 */
    __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8);
    for (int t = 16; t < n; t += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + t), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + t + 8), m1);
    }
    float lanes[16];
    _mm256_storeu_ps(lanes, m0);
    _mm256_storeu_ps(lanes + 8, m1);
    float best = lanes[0];
    for (int i = 1; i < 16; i++) best = lanes[i] > best ? lanes[i] : best;
    return best;
#else
    v16f m;
    memcpy(&m, x, sizeof m);
    for (int t = 16; t < n; t += 16) {
        v16f v;
        memcpy(&v, x + t, sizeof v);
        v16i more = v > m;
        m = (v16f)((more & (v16i)v) | (~more & (v16i)m));
    }
    float best = m[0];
    for (int i = 1; i < 16; i++) best = m[i] > best ? m[i] : best;
    return best;
#endif
}

/* softmax of each head's scores, in place (rows `stride` apart, n scores each, then
 * repeats of the last one up to a multiple of 16, which the maximum may include, so
 * they are capped too); sinks: one per row, or NULL. */
static void softmax_rows(float *scores, int rows, int64_t stride, int n, const float *sinks,
                         float softcap) {
    const int padded = (n + 15) / 16 * 16;
    for (int g = 0; g < rows; g++) {
        float *sg = scores + g * stride;
        softcap_scores(sg, padded, softcap);
        normalise(sg, n, max16(sg, padded), sinks != NULL ? sinks + g : NULL);
    }
}

/* Scores of the group's query heads (rows q_off + g head_dim of q) against the keys
 * at off[0..padded), times scale, into scores [group, padded]: a tile of keys at a
 * time, each K row read from L1 once per query head (the first read brings it in). */
static inline __attribute__((always_inline)) void scores_fp32(
        const void *q, int64_t q_off, const void *kv, const int64_t *off, int padded,
        int64_t v_offset, int row_bytes, const int head_dim, const int group, float scale,
        const int dtype, float *scores) {
    v16f qv[MAX_GROUP][MAX_VECS];  /* scaled, in pair order */
    for (int g = 0; g < group; g++) {
        float row[128], qs[128];
        load_row(q, q_off + g * head_dim, dtype, head_dim, row);
        for (int d = 0; d < head_dim; d++) qs[pair_pos(d, dtype)] = row[d] * scale;
        memcpy(qv[g], qs, sizeof(float) * head_dim);
    }
    for (int t = 0; t < padded; t += TILE) {
        if (t + TILE < padded)
            prefetch_tile(kv, off + t + TILE, v_offset, row_bytes, head_dim, dtype);
        for (int g = 0; g < group; g++) {
            v16f s = tile_scores(kv, off + t, qv[g], head_dim, dtype);
            memcpy(scores + (int64_t)g * padded + t, &s, sizeof s);
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define USE_DPBF16 1
/* scores_fp32 for bf16 caches with AVX512_BF16: vdpbf16ps multiplies pairs of bf16
 * straight from the cache and adds them in float32, 32 products an instruction and
 * no widening. Exact where it matters: q is bfloat16 already (the cache's dtype), so
 * it is used unscaled, and a product of two bf16 is exact in float32; the scale is
 * applied to the sums. (vdpbf16ps flushes denormals: values below 1e-38.) */
static inline __attribute__((always_inline)) void scores_dpbf16(
        const void *q, int64_t q_off, const void *kv, const int64_t *off, int padded,
        int64_t v_offset, int row_bytes, const int head_dim, const int group, float scale,
        float *scores) {
    __m512i qv[MAX_GROUP][MAX_VECS / 2];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < head_dim / 32; c++)
            qv[g][c] = _mm512_loadu_si512((const uint16_t *)q + q_off + g * head_dim + 32 * c);
    for (int t = 0; t < padded; t += TILE) {
        if (t + TILE < padded)
            prefetch_tile(kv, off + t + TILE, v_offset, row_bytes, head_dim, DTYPE_BF16);
        for (int g = 0; g < group; g++) {
            v16f dots[TILE];
            for (int j = 0; j < TILE; j++) {
                __m512 s = _mm512_setzero_ps();
                for (int c = 0; c < head_dim / 32; c++) {
                    __m512i k = _mm512_loadu_si512((const uint16_t *)kv + off[t + j] + 32 * c);
                    s = _mm512_dpbf16_ps(s, (__m512bh)qv[g][c], (__m512bh)k);
                }
                dots[j] = (v16f)s;
            }
            v16f sum = sum_lanes16(dots) * scale;
            memcpy(scores + (int64_t)g * padded + t, &sum, sizeof sum);
        }
    }
}
#else
#define USE_DPBF16 0
#endif

#if defined(AVX2_ONLY)
/* Lane j: the sum of d[j]'s 8 lanes (a tree of horizontal adds). */
static inline __attribute__((always_inline)) __m256 sum_lanes8(const __m256 d[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores_fp32 for a bf16 cache on AVX2, in its own 8-lane registers (tile_scores's 16
 * sums of 16 lanes would be 32 of its 16 registers): 8 keys' sums at a time, each K
 * chunk of 16 values widened to its 8 even and 8 odd ones (pair order: see
 * weighted_values_avx2), q read from L1. */
static inline __attribute__((always_inline)) void scores_avx2(
        const void *q, int64_t q_off, const void *kv, const int64_t *off, int padded,
        int64_t v_offset, int row_bytes, const int head_dim, const int group, float scale,
        float *scores) {
    float qs[MAX_GROUP][128];  /* scaled, in pair order */
    for (int g = 0; g < group; g++) {
        float row[128];
        load_row(q, q_off + g * head_dim, DTYPE_BF16, head_dim, row);
        for (int d = 0; d < head_dim; d++) qs[g][pair_pos(d, DTYPE_BF16)] = row[d] * scale;
    }
    const uint16_t *cache = (const uint16_t *)kv;
    for (int t = 0; t < padded; t += TILE) {
        if (t + TILE < padded)
            prefetch_tile(kv, off + t + TILE, v_offset, row_bytes, head_dim, DTYPE_BF16);
        for (int g = 0; g < group; g++)
            for (int h = 0; h < TILE / 8; h++) {
                __m256 dots[8];
                for (int j = 0; j < 8; j++) {
                    __m256 s = _mm256_setzero_ps();
                    for (int c = 0; c < head_dim / 16; c++) {
                        const __m256i w = _mm256_loadu_si256(
                            (const __m256i *)(cache + off[t + 8 * h + j] + 16 * c));
                        const float *qc = qs[g] + 32 * (c / 2) + 8 * (c % 2);
                        __m256 even, odd;
                        bf16_halves8(w, &even, &odd);
                        s = _mm256_fmadd_ps(_mm256_loadu_ps(qc), even, s);
                        s = _mm256_fmadd_ps(_mm256_loadu_ps(qc + 16), odd, s);
                    }
                    dots[j] = s;
                }
                _mm256_storeu_ps(scores + (int64_t)g * padded + t + 8 * h, sum_lanes8(dots));
            }
    }
}
#endif

/* The scores pass specialised on head_dim and dtype only: the group is a loop here
 * (its q rows are read from L1 with the keys), which costs little and keeps the
 * build fast (fully unrolled tiles for every group size took seconds to compile). */
static __attribute__((noinline)) void score_tiles(
        const void *q, int64_t q_off, const void *kv, const int64_t *off, int padded,
        int64_t v_offset, int row_bytes, int head_dim, int group, float scale, int dtype,
        float *scores) {
#define SCORES_FP32(HD, DT) scores_fp32(q, q_off, kv, off, padded, v_offset, row_bytes, HD, \
                                        group, scale, DT, scores)
#if USE_DPBF16
    if (dtype == DTYPE_BF16 && head_dim == 64)
        scores_dpbf16(q, q_off, kv, off, padded, v_offset, row_bytes, 64, group, scale,
                      scores);
    else if (dtype == DTYPE_BF16)
        scores_dpbf16(q, q_off, kv, off, padded, v_offset, row_bytes, 128, group, scale,
                      scores);
#elif defined(AVX2_ONLY)
    if (dtype == DTYPE_BF16 && head_dim == 64)
        scores_avx2(q, q_off, kv, off, padded, v_offset, row_bytes, 64, group, scale, scores);
    else if (dtype == DTYPE_BF16)
        scores_avx2(q, q_off, kv, off, padded, v_offset, row_bytes, 128, group, scale, scores);
#else
    if (dtype == DTYPE_BF16 && head_dim == 64) SCORES_FP32(64, DTYPE_BF16);
    else if (dtype == DTYPE_BF16) SCORES_FP32(128, DTYPE_BF16);
#endif
    else if (head_dim == 64) SCORES_FP32(64, DTYPE_F32);
    else SCORES_FP32(128, DTYPE_F32);
#undef SCORES_FP32
}

/* The next sequence a thread will attend (whole_rows mode): its K and V token rows
 * are asked for into L2 while this one's values are summed, one token row a step, so
 * that its first head finds them there instead of waiting on memory. */
struct lookahead {
    const char *k;        /* the layer cache's K rows (V rows v_bytes further) */
    int64_t v_bytes;
    const int32_t *table; /* the next sequence's block table */
    int len, next;        /* its context length; the next token row to ask for */
    int block_size, row_bytes;
};

static inline __attribute__((always_inline)) void lookahead_row(struct lookahead *la) {
    /* la: NULL where there is no next sequence (or not whole_rows mode) */
    if (la == NULL || la->next >= la->len) return;
    const int tok = la->next++;
    const char *row = la->k + ((int64_t)la->table[tok / la->block_size] * la->block_size
                               + tok % la->block_size) * la->row_bytes;
    for (int b = 0; b < la->row_bytes; b += 64) {
        __builtin_prefetch(row + b, 0, 2);
        __builtin_prefetch(row + la->v_bytes + b, 0, 2);
    }
}

/* The weighted sum of V rows for the whole group, each row widened once, with the
 * group's accumulators in registers (head_dim and group constants): into acc
 * [group, head_dim], in pair order. */
static inline __attribute__((always_inline)) void weighted_values(
        const void *kv, const int64_t *off, int seq_len, int64_t v_offset,
        const float *probs, int padded, const int head_dim, const int group,
        const int dtype, struct lookahead *la, float *acc_out) {
    const int nv = head_dim / 16;  /* vectors per row */
    v16f acc[MAX_GROUP][MAX_VECS];
    for (int g = 0; g < group; g++)
        for (int k = 0; k < nv; k++) acc[g][k] = (v16f){0};
    prefetch_rows(kv, v_offset, off, PREFETCH_AHEAD < seq_len ? PREFETCH_AHEAD : seq_len,
                  head_dim, dtype);
    for (int t = 0; t < seq_len; t++) {
        if (t + PREFETCH_AHEAD < seq_len)
            prefetch_rows(kv, v_offset, off + t + PREFETCH_AHEAD, 1, head_dim, dtype);
        lookahead_row(la);
        v16f v[MAX_VECS];
        for (int c = 0; c < nv / 2; c++)
            load_pair(kv, v_offset + off[t] + 32 * c, dtype, &v[2 * c], &v[2 * c + 1]);
        for (int g = 0; g < group; g++) {
            const float p = probs[(int64_t)g * padded + t];
            for (int k = 0; k < nv; k++) acc[g][k] += p * v[k];
        }
    }
    for (int g = 0; g < group; g++)
        memcpy(acc_out + g * head_dim, acc[g], sizeof(float) * head_dim);
}

#if defined(AVX2_ONLY)
/* weighted_values for a bf16 cache on AVX2, in its own 8-lane registers: 16 values of
 * each row at a time (a pass over the context per 16 of head_dim), so that the
 * group's sums fit its 16 registers up to a group of 6 (7 and 8 spill a few; the
 * 16-lane vectors of weighted_values would be two registers each, kept on the stack:
 * a quarter of a 32-stream decode step went there). A load of 16 bf16 values widens
 * to 8 even and 8 odd ones: in pair order (load_pair), positions 32p + 8h + i and
 * 32p + 16 + 8h + i of the row's pair block p, half h. The same sums in the same
 * order as weighted_values. */
static inline __attribute__((always_inline)) void weighted_values_avx2(
        const void *kv, const int64_t *off, int seq_len, int64_t v_offset,
        const float *probs, int padded, const int head_dim, const int group,
        struct lookahead *la, float *acc_out) {
    const uint16_t *cache = (const uint16_t *)kv + v_offset;
    prefetch_rows(kv, v_offset, off, PREFETCH_AHEAD < seq_len ? PREFETCH_AHEAD : seq_len,
                  head_dim, DTYPE_BF16);
    for (int c = 0; c < head_dim / 16; c++) {
        __m256 even[MAX_GROUP], odd[MAX_GROUP];
        for (int g = 0; g < group; g++) even[g] = odd[g] = _mm256_setzero_ps();
        for (int t = 0; t < seq_len; t++) {
            if (c == 0) {  /* the first pass brings the rows in; the others find them */
                if (t + PREFETCH_AHEAD < seq_len)
                    prefetch_rows(kv, v_offset, off + t + PREFETCH_AHEAD, 1, head_dim,
                                  DTYPE_BF16);
                lookahead_row(la);
            }
            const __m256i w = _mm256_loadu_si256((const __m256i *)(cache + off[t] + 16 * c));
            __m256 lo, hi;
            bf16_halves8(w, &lo, &hi);
            for (int g = 0; g < group; g++) {
                const __m256 p = _mm256_broadcast_ss(&probs[(int64_t)g * padded + t]);
                even[g] = _mm256_fmadd_ps(p, lo, even[g]);
                odd[g] = _mm256_fmadd_ps(p, hi, odd[g]);
            }
        }
        const int base = 32 * (c / 2) + 8 * (c % 2);
        for (int g = 0; g < group; g++) {
            _mm256_storeu_ps(acc_out + g * head_dim + base, even[g]);
            _mm256_storeu_ps(acc_out + g * head_dim + base + 16, odd[g]);
        }
    }
}
#endif

/* weighted_values for each (head_dim, group, dtype) the fast path takes (each group
 * size with AVX-512's 32 registers, and with AVX2's 16 for bf16 caches by
 * weighted_values_avx2: elsewhere it would only spill, and compile for long). */
static __attribute__((noinline)) void value_pass(
        const void *kv, const int64_t *off, int seq_len, int64_t v_offset,
        const float *probs, int padded, int head_dim, int group, int dtype,
        struct lookahead *la, float *acc) {
#define VALUES(HD, G, DT) weighted_values(kv, off, seq_len, v_offset, probs, padded, HD, G, \
                                          DT, la, acc)
#if defined(__AVX512F__)
#define VALUES_G(HD, DT)                                                        \
    switch (group) {                                                            \
    case 1: VALUES(HD, 1, DT); return;                                          \
    case 2: VALUES(HD, 2, DT); return;                                          \
    case 3: VALUES(HD, 3, DT); return;                                          \
    case 4: VALUES(HD, 4, DT); return;                                          \
    case 5: VALUES(HD, 5, DT); return;                                          \
    case 6: VALUES(HD, 6, DT); return;                                          \
    case 7: VALUES(HD, 7, DT); return;                                          \
    default: VALUES(HD, 8, DT); return;                                         \
    }
#else  /* 16 vector registers or fewer: the accumulators would not fit anyway */
#define VALUES_G(HD, DT) { VALUES(HD, group, DT); return; }
#endif
#if defined(AVX2_ONLY)
#define VALUES_AVX2(G) \
    weighted_values_avx2(kv, off, seq_len, v_offset, probs, padded, head_dim, G, la, acc)
    if (dtype == DTYPE_BF16) {  /* the group a constant: its sums stay in registers */
        switch (group) {
        case 1: VALUES_AVX2(1); return;
        case 2: VALUES_AVX2(2); return;
        case 3: VALUES_AVX2(3); return;
        case 4: VALUES_AVX2(4); return;
        case 5: VALUES_AVX2(5); return;
        case 6: VALUES_AVX2(6); return;
        case 7: VALUES_AVX2(7); return;
        case 8: VALUES_AVX2(8); return;  /* (attend_tiled takes groups up to MAX_GROUP) */
        default: break;
        }
    }
#undef VALUES_AVX2
#endif
    if (dtype == DTYPE_BF16 && head_dim == 64) VALUES_G(64, DTYPE_BF16)
    else if (dtype == DTYPE_BF16) VALUES_G(128, DTYPE_BF16)
    else if (head_dim == 64) VALUES_G(64, DTYPE_F32)
    else VALUES_G(128, DTYPE_F32)
#undef VALUES_G
#undef VALUES
}

/* One (sequence, KV head) task, as attend_one, for head_dim 64 or 128 and a group of
 * at most MAX_GROUP: two passes over the context (scores, then values), each
 * specialised where it pays. Scratch: key offsets, scores, accumulators. */
static void attend_tiled(const void *q, int64_t q_stride, void *out, const void *kv,
                         int64_t q_row, const int32_t *table, int first, int seq_len,
                         int64_t v_offset, int block_size, int num_heads, int kv_heads,
                         int head_dim, int kv_head, float scale, const float *sinks,
                         float softcap, int dtype, int whole_rows, struct lookahead *la,
                         void *scratch) {
    const int group = num_heads / kv_heads;
    const int n = seq_len - first;  /* the keys this row sees */
    const int padded = (n + TILE - 1) / TILE * TILE;
    int64_t *off = key_offsets(scratch, table, first, seq_len, block_size,
                               (int64_t)kv_heads * head_dim, (int64_t)kv_head * head_dim);
    float *scores = (float *)(off + padded);          /* [group, padded] */
    float *acc = scores + (int64_t)group * padded;    /* [group, head_dim] */
    const int64_t q_off = q_row * q_stride + (int64_t)kv_head * group * head_dim;
    /* the first head of a sequence warms L2 with every head's rows for the others */
    const int row_bytes = whole_rows && kv_head == 0
                          ? kv_heads * head_dim * (dtype == DTYPE_BF16 ? 2 : 4) : 0;
    score_tiles(q, q_off, kv, off, padded, v_offset, row_bytes, head_dim, group, scale, dtype,
                scores);
    softmax_rows(scores, group, padded, n, sinks != NULL ? sinks + kv_head * group : NULL,
                 softcap);
    value_pass(kv, off, n, v_offset, scores, padded, head_dim, group, dtype, la, acc);
    for (int g = 0; g < group; g++) {
        const float *a = acc + g * head_dim;
        int64_t o = (q_row * num_heads + (int64_t)kv_head * group + g) * head_dim;
        for (int d = 0; d < head_dim; d++) {
            float x = a[pair_pos(d, dtype)];
            if (dtype == DTYPE_BF16) ((uint16_t *)out)[o + d] = f32_to_bf16(x);
            else ((float *)out)[o + d] = x;
        }
    }
}

/* attend_one specialised for the common head sizes and each dtype, where
 * attend_tiled does not apply. */
#define ATTEND(HD, DT) attend_one(q, q_stride, out, kv, q_row, table, first, seq_len, v_offset, \
                                  block_size, num_heads, kv_heads, HD, kv_head, scale, sinks, \
                                  softcap, DT, scratch)
static void attend(const void *q, int64_t q_stride, void *out, const void *kv,
                   int64_t q_row, const int32_t *table, int first, int seq_len,
                   int64_t v_offset,
                   int block_size, int num_heads, int kv_heads, int head_dim, int kv_head,
                   float scale, const float *sinks, float softcap, int dtype, int whole_rows,
                   struct lookahead *la, float *scratch) {
    if ((head_dim == 64 || head_dim == 128) && num_heads / kv_heads <= MAX_GROUP) {
        attend_tiled(q, q_stride, out, kv, q_row, table, first, seq_len, v_offset, block_size,
                     num_heads, kv_heads, head_dim, kv_head, scale, sinks, softcap, dtype,
                     whole_rows, la, scratch);
    } else if (dtype == DTYPE_BF16) {
        if (head_dim == 64) ATTEND(64, DTYPE_BF16);
        else if (head_dim == 128) ATTEND(128, DTYPE_BF16);
        else ATTEND(head_dim, DTYPE_BF16);
    } else {
        if (head_dim == 64) ATTEND(64, DTYPE_F32);
        else if (head_dim == 128) ATTEND(128, DTYPE_F32);
        else ATTEND(head_dim, DTYPE_F32);
    }
}

/* Zeros for `count` query heads from `first` of row q_row: a sequence with no context
 * (a decode always sees itself, so only a caller's padding row). */
static void zero_heads(void *out, int64_t q_row, int num_heads, int first, int count,
                       int head_dim, int dtype) {
    const size_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t off = (q_row * num_heads + first) * head_dim;
    memset((char *)out + off * elem, 0, elem * count * head_dim);
}

/* whole_rows mode, run by each thread: sequences claimed from the shared counter one
 * ahead, so the next one is known while this one runs (the balance of a dynamic
 * schedule, plus the lookahead: its rows are asked for during this one's value
 * passes, and its first head then reads them from L2 instead of waiting on memory;
 * measured 15-30% less time a layer once the cache is past L3). */
static void attend_claimed(const void *q, int64_t q_stride, void *out, const void *kv,
                           const int32_t *q_rows, const int32_t *tables, int table_stride,
                           const int32_t *first_keys, const int32_t *seq_lens, int num_seqs,
                           int64_t v_offset,
                           int block_size, int num_heads, int kv_heads, int head_dim,
                           float scale, const float *sinks, float softcap, int dtype,
                           int *claimed, float *scratch) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int group = num_heads / kv_heads;
    int cur = __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED);
    while (cur < num_seqs) {
        const int next = __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED);
        struct lookahead ahead = {(const char *)kv, v_offset * elem, NULL, 0, 0, block_size,
                                  kv_heads * head_dim * elem};
        if (next < num_seqs) {
            ahead.table = tables + (int64_t)next * table_stride;
            ahead.len = seq_lens[next];
            ahead.next = first_keys != NULL ? first_keys[next] : 0;
        }
        for (int h = 0; h < kv_heads; h++) {
            if (seq_lens[cur] <= 0) {
                zero_heads(out, q_rows[cur], num_heads, h * group, group, head_dim, dtype);
                continue;
            }
            attend(q, q_stride, out, kv, q_rows[cur], tables + (int64_t)cur * table_stride,
                   first_keys != NULL ? first_keys[cur] : 0, seq_lens[cur], v_offset,
                   block_size, num_heads, kv_heads, head_dim, h, scale, sinks, softcap, dtype,
                   1, ahead.len > 0 ? &ahead : NULL, scratch);
        }
        cur = next;
    }
}

/* q: rows q_stride elements apart, heads head_dim apart; out: [rows, num_heads,
 * head_dim] contiguous; q_rows[i]: the row of sequence i; tables:
 * [num_seqs, table_stride] block ids; seq_lens[i]: tokens in sequence i's context
 * (its new token's K/V already written); first_keys[i]: the first of them it attends
 * to (a sliding window: seq_len - window where that is positive), or NULL: every one.
 * sinks: [num_heads] float32 logits that join each head's softmax denominator only
 * (gpt-oss's attention sinks), or NULL; softcap > 0: scores become
 * softcap * tanh(scores / softcap) before the softmax (Gemma 2), 0: left as they are.
 * Returns 0, or -1 when out of memory. */
int paged_decode(int num_threads, const void *q, int64_t q_stride, void *out, const void *kv,
                 const int32_t *q_rows, const int32_t *tables, int table_stride,
                 const int32_t *first_keys, const int32_t *seq_lens,
                 int num_seqs, int64_t num_cache_blocks, int block_size, int num_heads,
                 int kv_heads, int head_dim, float scale, const float *sinks, float softcap,
                 int dtype) {
    int max_len = 0;
    for (int i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int group = num_heads / kv_heads;
    const size_t padded = (size_t)(max_len + TILE - 1) / TILE * TILE;
    /* attend_one's [2 group + 1, head_dim] + [group, max_len], or attend_tiled's key
     * offsets (int64) + [group, padded] scores + [group, head_dim]: room for either. */
    const size_t scratch_floats = (size_t)(2 * group + 1) * head_dim + 2 * padded
                                  + (size_t)group * padded;
    const int64_t v_offset = num_cache_blocks * block_size * kv_heads * head_dim;
    const int tasks = num_seqs * kv_heads;
    /* With sequences enough to keep every thread busy, one thread takes all the KV
     * heads of a sequence in turn (attend_claimed), and the first warms its L2 for the
     * others. */
    const int whole_rows = kv_heads > 1 && num_seqs >= 4 * num_threads;
    int failed = 0, claimed = 0;
    /* torch's thread count, passed in: the OpenMP runtime this library links may not be
     * the one torch configured (a renamed libgomp, clang's libomp). */
    #pragma omp parallel num_threads(num_threads) reduction(|:failed) if(tasks > 1)
    {
        float *scratch = malloc(scratch_floats * sizeof(float));
        failed = scratch == NULL;
        if (whole_rows) {
            if (scratch != NULL)
                attend_claimed(q, q_stride, out, kv, q_rows, tables, table_stride, first_keys,
                               seq_lens, num_seqs, v_offset, block_size, num_heads, kv_heads, head_dim,
                               scale, sinks, softcap, dtype, &claimed, scratch);
        } else {
            /* Every thread takes part in the loop (a work-sharing construct), even one
             * whose allocation failed: it then skips its tasks and the call reports it. */
            #pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < tasks; task++) {
                if (scratch == NULL) continue;
                int i = task / kv_heads, h = task % kv_heads;
                if (seq_lens[i] <= 0) {
                    zero_heads(out, q_rows[i], num_heads, h * group, group, head_dim, dtype);
                    continue;
                }
                attend(q, q_stride, out, kv, q_rows[i], tables + (int64_t)i * table_stride,
                       first_keys != NULL ? first_keys[i] : 0, seq_lens[i], v_offset, block_size, num_heads, kv_heads, head_dim, h,
                       scale, sinks, softcap, dtype, 0, NULL, scratch);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Rotary embedding of one head (Hugging Face's "rotate half": the two halves pair up),
 * in float32, rounded to the cache dtype: bit for bit what the torch path computes
 * (multiplications and the sum rounded separately, so no fused multiply-add here). */
__attribute__((optimize("fp-contract=off")))
static void rotate_head(const void *src, int64_t src_off, void *dst, int64_t dst_off,
                        const float *cos, const float *sin, int head_dim, int dtype) {
    const int half = head_dim / 2;
    float x[512];  /* head_dim <= 512, checked by the caller */
    load_row(src, src_off, dtype, head_dim, x);
    for (int d = 0; d < half; d++) {
        float a = x[d], b = x[d + half];
        float lo_1 = a * cos[d], lo_2 = b * sin[d];
        float hi_1 = b * cos[d], hi_2 = a * sin[d];
        float lo = lo_1 - lo_2, hi = hi_1 + hi_2;
        if (dtype == DTYPE_BF16) {
            ((uint16_t *)dst)[dst_off + d] = f32_to_bf16(lo);
            ((uint16_t *)dst)[dst_off + d + half] = f32_to_bf16(hi);
        } else {
            ((float *)dst)[dst_off + d] = lo;
            ((float *)dst)[dst_off + d + half] = hi;
        }
    }
}

/* rotate_head for bf16, 16 lanes at a time (half a multiple of 16): the same
 * products and sums, each rounded as there. */
__attribute__((optimize("fp-contract=off")))
static void rotate_head_bf16(const uint16_t *src, uint16_t *dst, const float *cos,
                             const float *sin, int half) {
    for (int d = 0; d < half; d += 16) {
        v16f a = load16_bf16(src + d), b = load16_bf16(src + d + half), c, s;
        memcpy(&c, cos + d, sizeof c);
        memcpy(&s, sin + d, sizeof s);
        v16f lo_1 = a * c, lo_2 = b * s, hi_1 = b * c, hi_2 = a * s;
        store16_bf16(dst + d, lo_1 - lo_2);
        store16_bf16(dst + d + half, hi_1 + hi_2);
    }
}

/* One token of rope_and_cache, bf16: its query heads rotated into q, its K heads
 * rotated and V heads copied into the cache row at cache_row (negative: padding). */
static void rope_token_bf16(const uint16_t *qkv, uint16_t *q, uint16_t *kv, int64_t cache_row,
                            int64_t v_offset, const float *cos, const float *sin,
                            int num_heads, int kv_heads, int head_dim) {
    for (int h = 0; h < num_heads; h++)
        rotate_head_bf16(qkv + (int64_t)h * head_dim, q + (int64_t)h * head_dim, cos, sin,
                         head_dim / 2);
    if (cache_row < 0) return;
    for (int h = 0; h < kv_heads; h++)
        rotate_head_bf16(qkv + (int64_t)(num_heads + h) * head_dim,
                         kv + cache_row + (int64_t)h * head_dim, cos, sin, head_dim / 2);
    memcpy(kv + v_offset + cache_row, qkv + (int64_t)(num_heads + kv_heads) * head_dim,
           sizeof(uint16_t) * kv_heads * head_dim);
}

/* For each of num_tokens tokens of the fused projection qkv [tokens, num_heads +
 * 2 kv_heads, head_dim] (rows qkv_stride elements apart): the rotated query heads into
 * q_out [tokens, num_heads, head_dim], and the rotated K and the V heads into the layer
 * cache at flat slot slots[t] (negative: padding, skipped). cos, sin: [tokens,
 * head_dim / 2] float32. Returns 0, or -1 for an unsupported head_dim. */
int rope_and_cache(int num_threads, const void *qkv, int64_t qkv_stride, void *q_out,
                   void *kv, const float *cos, const float *sin, const int64_t *slots,
                   int num_tokens, int64_t num_cache_blocks, int block_size, int num_heads,
                   int kv_heads, int head_dim, int dtype) {
    if (head_dim > 512 || head_dim % 2) return -1;
    const int64_t v_offset = num_cache_blocks * block_size * kv_heads * head_dim;
    const size_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) if(num_tokens > 8)
    for (int t = 0; t < num_tokens; t++) {
        const float *c = cos + (int64_t)t * half, *s = sin + (int64_t)t * half;
        const int64_t row = (int64_t)t * qkv_stride;
        if (dtype == DTYPE_BF16 && half % 16 == 0) {
            rope_token_bf16((const uint16_t *)qkv + row, (uint16_t *)q_out
                            + (int64_t)t * num_heads * head_dim, (uint16_t *)kv, slots[t]
                            * kv_heads * head_dim, v_offset, c, s, num_heads, kv_heads,
                            head_dim);
            continue;
        }
        for (int h = 0; h < num_heads; h++)
            rotate_head(qkv, row + (int64_t)h * head_dim, q_out,
                        ((int64_t)t * num_heads + h) * head_dim, c, s, head_dim, dtype);
        if (slots[t] < 0) continue;
        const int64_t cache_row = slots[t] * kv_heads * head_dim;
        for (int h = 0; h < kv_heads; h++) {
            rotate_head(qkv, row + (int64_t)(num_heads + h) * head_dim, kv,
                        cache_row + (int64_t)h * head_dim, c, s, head_dim, dtype);
            memcpy((char *)kv + (v_offset + cache_row + (int64_t)h * head_dim) * elem,
                   (const char *)qkv + (row + (int64_t)(num_heads + kv_heads + h) * head_dim)
                   * elem, elem * head_dim);
        }
    }
    return 0;
}

/* RMSNorm of bfloat16 rows as Hugging Face computes it: float32 statistics, the
 * normalised row rounded to bfloat16, then times the bfloat16 weight (rounded again).
 * With delta != NULL, first residual = x + delta (rounded), written to residual_out:
 * the decoder layer's "add, then normalise" in one pass. */
int add_rms_norm_bf16(int num_threads, const uint16_t *x, const uint16_t *delta,
                      const uint16_t *weight, uint16_t *out, uint16_t *residual_out,
                      int rows, int dim, float eps) {
    if (dim > 16384) return -1;
    #pragma omp parallel for num_threads(num_threads) if(rows > 8)
    for (int r = 0; r < rows; r++) {
        float v[16384];
        const int64_t off = (int64_t)r * dim;
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) {
            float a = bf16_to_f32(x[off + d]);
            if (delta != NULL) {
                uint16_t s = f32_to_bf16(a + bf16_to_f32(delta[off + d]));
                residual_out[off + d] = s;
                a = bf16_to_f32(s);
            }
            v[d] = a;
            sum += a * a;
        }
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int d = 0; d < dim; d++) {
            float normed = bf16_to_f32(f32_to_bf16(v[d] * inv));
            out[off + d] = f32_to_bf16(normed * bf16_to_f32(weight[d]));
        }
    }
    return 0;
}

/* act [rows, inter] = silu(gate) * up for gate_up [rows, 2 inter] (gate columns, then
 * up), bfloat16: silu(gate) rounded to bf16, then times up, rounded again, as torch's
 * F.silu(gate) * up rounds. exp is exp_inplace's polynomial (relative error ~1e-7, as
 * torch's vectorised exp): a bf16 result can differ from torch's by one unit where the
 * float32 value lies that close to a rounding boundary. */
int silu_and_mul_bf16(int num_threads, const uint16_t *gate_up, int rows, int64_t inter,
                      uint16_t *act) {
    enum { CHUNK = 256 };
    const int64_t chunks = (inter + CHUNK - 1) / CHUNK;
    #pragma omp parallel for num_threads(num_threads) if(rows * inter >= 16384)
    for (int64_t task = 0; task < rows * chunks; task++) {
        const int64_t r = task / chunks, start = task % chunks * CHUNK;
        const int n = (int)(inter - start < CHUNK ? inter - start : CHUNK);
        const uint16_t *gate = gate_up + r * 2 * inter + start, *up = gate + inter;
        uint16_t *dst = act + r * inter + start;
        float g[CHUNK], e[CHUNK];
        for (int i = 0; i < n; i++) {
            g[i] = bf16_to_f32(gate[i]);
            e[i] = -g[i] > 88.0f ? 88.0f : -g[i];  /* exp_inplace's range */
        }
        exp_inplace(e, n);
        for (int i = 0; i < n; i++) {
            /* silu -> -0 for g below -88 (torch: below -88.7, where exp(-g) overflows;
             * in between, its values are under 1e-36) */
            float den = g[i] < -88.0f ? INFINITY : 1.0f + e[i];
            float silu = bf16_to_f32(f32_to_bf16(g[i] / den));
            dst[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
        }
    }
    return 0;
}

#if !defined(AVX2_ONLY)
/* The first index of a row's largest value (of its first NaN, if it has one), as
 * torch.argmax: lane-wise maxima first, then the first 16-wide chunk holding the
 * row's maximum. */
static int64_t argmax_row(const uint16_t *row, int64_t n) {
    const int64_t whole = n / 16 * 16;
    v16f best = (v16f){0} - INFINITY;
    v16i nan = (v16i){0};
    for (int64_t i = 0; i < whole; i += 16) {
        v16f v = load16_bf16(row + i);
        v16i greater = v > best;
        best = (v16f)((greater & (v16i)v) | (~greater & (v16i)best));
        nan |= v != v;
    }
    float m = -INFINITY;
    int any_nan = 0;
    for (int j = 0; j < 16; j++) {
        m = best[j] > m ? best[j] : m;
        any_nan |= nan[j] != 0;
    }
    for (int64_t i = whole; i < n; i++) {
        float v = bf16_to_f32(row[i]);
        any_nan |= v != v;
        m = v > m ? v : m;
    }
    int64_t k = 0;
    for (; k < whole; k += 16) {  /* skip chunks without the answer */
        v16f v = load16_bf16(row + k);
        v16i hit = any_nan ? v != v : v == m;
        int any = 0;
        for (int j = 0; j < 16; j++) any |= hit[j] != 0;
        if (any) break;
    }
    for (; k < n; k++) {
        float v = bf16_to_f32(row[k]);
        if (any_nan ? v != v : v == m) break;
    }
    return k < n ? k : 0;
}
#else
/* The first index of a row's largest value (of its first NaN, if it has one), as
 * torch.argmax, in AVX2's own registers. GCC compiled the AVX-512 build's 16-lane
 * selects and lane tests lane by lane here (scalar compares and moves: 7x that build's
 * time, ~2% of a 32-stream run). VMAXPS(v, best) is the same select (a NaN v keeps
 * best); the answer's lane comes from a compare mask. */
static int64_t argmax_row(const uint16_t *row, int64_t n) {
    const int64_t whole = n / 16 * 16;
    __m256 best0 = _mm256_set1_ps(-INFINITY), best1 = best0, nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 16) {
        const __m256 v0 = load8_bf16(row + i), v1 = load8_bf16(row + i + 8);
        best0 = _mm256_max_ps(v0, best0);
        best1 = _mm256_max_ps(v1, best1);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, _mm256_max_ps(best0, best1));
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t i = whole; i < n; i++) {
        float v = bf16_to_f32(row[i]);
        any_nan |= v != v;
        m = v > m ? v : m;
    }
    const __m256 target = _mm256_set1_ps(m);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 v = load8_bf16(row + k);
        const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                   : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hit) return k + __builtin_ctz((unsigned)hit);
    }
    for (; k < n; k++) {
        float v = bf16_to_f32(row[k]);
        if (any_nan ? v != v : v == m) return k;
    }
    return 0;
}
#endif

/* argmax_row of each row: greedy sampling straight from bfloat16 logits [rows, n] (row
 * stride `stride`), without a float32 copy. */
int argmax_rows_bf16(int num_threads, const uint16_t *x, int rows, int64_t n, int64_t stride,
                     int64_t *out) {
    #pragma omp parallel for num_threads(num_threads) if(rows > 1)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * stride, n);
    return 0;
}
