/* Paged-attention decode on CPUs: one new query token per sequence, attending over
 * its whole context in the paged KV cache.
 *
 * Each (sequence, KV head) task reads that head's K and V rows of every block once,
 * for the whole GQA group of query heads sharing it, straight from the cache: no
 * gathered or padded copy of the context, no mask. Scores, softmax and accumulation
 * are float32 whatever the cache dtype (float32 or bfloat16).
 *
 * Layer cache layout: [2 (K, V), num_blocks, block_size, kv_heads, head_dim].
 * Built and loaded by cpu_native.py (compiled for the machine it runs on).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

/* One (sequence, KV head) task. Inlined into callers with a constant head_dim and
 * dtype, so that the compiler unrolls and vectorises the head_dim loops fully. */
static inline __attribute__((always_inline)) void attend_one(
        const void *q, int64_t q_stride, void *out, const void *kv, int64_t q_row,
        const int32_t *table, int seq_len, int64_t v_offset, int block_size,
        int num_heads, int kv_heads, const int head_dim, int kv_head, float scale,
        const int dtype, float *scratch) {
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
    /* Scores: each K row read once for the whole group. */
    for (int b = 0; b < num_blocks; b++) {
        int64_t base = (int64_t)table[b] * block_size * token_stride
                       + (int64_t)kv_head * head_dim;
        int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        for (int j = 0; j < n; j++) {
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
        float *sg = scores + (int64_t)g * seq_len;
        float m = sg[0];
        for (int t = 1; t < seq_len; t++) m = sg[t] > m ? sg[t] : m;
        for (int t = 0; t < seq_len; t++) sg[t] -= m;
        exp_inplace(sg, seq_len);
        float sum = 0.0f;
        for (int t = 0; t < seq_len; t++) sum += sg[t];
        float inv = 1.0f / sum;
        for (int t = 0; t < seq_len; t++) sg[t] *= inv;
    }
    /* Weighted sum of V rows, each read once for the group. */
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int b = 0; b < num_blocks; b++) {
        int64_t base = v_offset + (int64_t)table[b] * block_size * token_stride
                       + (int64_t)kv_head * head_dim;
        int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        for (int j = 0; j < n; j++) {
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

/* attend_one specialised for the common head sizes and each dtype. */
#define ATTEND(HD, DT) attend_one(q, q_stride, out, kv, q_row, table, seq_len, v_offset, \
                                  block_size, num_heads, kv_heads, HD, kv_head, scale, DT, \
                                  scratch)
static void attend(const void *q, int64_t q_stride, void *out, const void *kv,
                   int64_t q_row, const int32_t *table, int seq_len, int64_t v_offset,
                   int block_size, int num_heads, int kv_heads, int head_dim, int kv_head,
                   float scale, int dtype, float *scratch) {
    if (dtype == DTYPE_BF16) {
        if (head_dim == 64) ATTEND(64, DTYPE_BF16);
        else if (head_dim == 128) ATTEND(128, DTYPE_BF16);
        else ATTEND(head_dim, DTYPE_BF16);
    } else {
        if (head_dim == 64) ATTEND(64, DTYPE_F32);
        else if (head_dim == 128) ATTEND(128, DTYPE_F32);
        else ATTEND(head_dim, DTYPE_F32);
    }
}

/* q: rows q_stride elements apart, heads head_dim apart; out: [rows, num_heads,
 * head_dim] contiguous; q_rows[i]: the row of sequence i; tables:
 * [num_seqs, table_stride] block ids; seq_lens[i]: tokens in sequence i's context
 * (its new token's K/V already written). Returns 0, or -1 when out of memory. */
int paged_decode(int num_threads, const void *q, int64_t q_stride, void *out, const void *kv, const int32_t *q_rows,
                 const int32_t *tables, int table_stride, const int32_t *seq_lens,
                 int num_seqs, int64_t num_cache_blocks, int block_size, int num_heads,
                 int kv_heads, int head_dim, float scale, int dtype) {
    int max_len = 0;
    for (int i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int group = num_heads / kv_heads;
    const size_t scratch_floats = (size_t)(2 * group + 1) * head_dim + (size_t)group * max_len;
    const int64_t v_offset = num_cache_blocks * block_size * kv_heads * head_dim;
    const int tasks = num_seqs * kv_heads;
    int failed = 0;
    /* torch's thread count, passed in: the OpenMP runtime this library links may not be
     * the one torch configured (a renamed libgomp, clang's libomp). */
    #pragma omp parallel num_threads(num_threads) reduction(|:failed) if(tasks > 1)
    {
        float *scratch = malloc(scratch_floats * sizeof(float));
        failed = scratch == NULL;
        /* Every thread takes part in the loop (a work-sharing construct), even one
         * whose allocation failed: it then skips its tasks and the call reports it. */
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            if (scratch == NULL) continue;
            int i = task / kv_heads, h = task % kv_heads;
            if (seq_lens[i] <= 0) {  /* no context (a decode always sees itself): zeros */
                size_t elem = dtype == DTYPE_BF16 ? 2 : 4;
                int64_t off = ((int64_t)q_rows[i] * num_heads + (int64_t)h * group) * head_dim;
                memset((char *)out + off * elem, 0, elem * group * head_dim);
                continue;
            }
            attend(q, q_stride, out, kv, q_rows[i], tables + (int64_t)i * table_stride,
                       seq_lens[i], v_offset, block_size, num_heads, kv_heads, head_dim,
                       h, scale, dtype, scratch);
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
