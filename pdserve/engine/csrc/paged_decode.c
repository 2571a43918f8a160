/*
 * Paged decode attention on the CPU, float32, read straight from the KV pool (a float32 pool,
 * or a float8 one whose block rows are widened to float32 one block at a time: below).
 *
 * One decode token per sequence attends over the sequence's whole KV (its context and the
 * token itself, already written to the pool). The torch path gathers each sequence's
 * blocks into a dense copy and runs masked SDPA on it: the KV is read twice and written
 * once. Here each (sequence, KV head) pair reads its K rows once and its V rows once, in
 * place, for all the query heads that share that KV head (grouped-query attention).
 *
 * Layouts (engine/attention.py; docs/architecture.md, "KV pool"):
 *   kv      one layer's pool [num_blocks][2 (K, V)][block_size][num_kv_heads][head_dim] (NHD), or
 *           [num_blocks][2][num_kv_heads][block_size][head_dim] (HND): the caller passes the
 *           floats between a head's consecutive tokens (tok_stride: num_kv_heads * head_dim or
 *           head_dim) and between consecutive heads of a token (head_stride: head_dim or
 *           block_size * head_dim)
 *   q       [tokens][num_heads][head_dim], row stride q_stride floats (a view into qkv)
 *   out     [tokens][num_heads][head_dim], contiguous
 *   tables  [num_seqs][max_blocks] int32 block ids; lens[i] tokens of sequence i in the pool;
 *           qidx[i] its query token's row in q and out.
 * Query head j reads KV head j / (num_heads / num_kv_heads), as HF's repeat_kv does.
 *
 * Softmax in float32 with the running maximum subtracted (exact zero weight for no token:
 * every listed token is attended). Work items are (sequence, KV head) pairs spread over
 * OpenMP threads; the library is linked against the OpenMP runtime torch has loaded, so
 * both share one thread pool. Built and loaded by engine/native.py.
 */
#include "exp_poly.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#else
#define PD_AVX2 0
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if PD_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc0 = _mm256_add_ps(acc0, acc1);
    __m128 lo = _mm256_castps256_ps128(acc0), hi = _mm256_extractf128_ps(acc0, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    s = _mm_cvtss_f32(lo);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#if PD_AVX2
/* Eight dot products q . k_j (k_j = k + j * stride, j < 8) of length n (a multiple of 8),
 * returned as one vector: eight accumulators reduced together with a horizontal-add tree. */
static inline __m256 dot8(const float *q, const float *k, int64_t stride, int64_t n) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + d), a[j]);
    }
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp(x) for x <= 0 (softmax weights after the maximum is subtracted): exp_poly.h's
 * polynomial, 8 lanes. */
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_MIN);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* s[0:n] = exp(s - max(s)); returns the sum. */
static inline float softmax_unnormalised(float *s, int64_t n) {
    float m = s[0];
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
    int64_t t = 0;
#if PD_AVX2
    __m256 vm = _mm256_set1_ps(m), vs = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(s + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vs);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}

/* acc[0:n] += sum_j w[j] * v_j for the tokens of one block (v_j = v + j * stride). */
static inline void accumulate_block(float *acc, const float *w, const float *v, int64_t stride,
                                    int64_t tokens, int64_t n) {
    int64_t d = 0;
#if PD_AVX2
    for (; d + 32 <= n; d += 32) {  /* four vectors of the output held in registers */
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int64_t j = 0; j < tokens; j++) {
            const float *vj = v + j * stride + d;
            __m256 wj = _mm256_set1_ps(w[j]);
            a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj), a0);
            a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8), a1);
            a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 16), a2);
            a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d + 8 <= n; d += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + d);
        for (int64_t j = 0; j < tokens; j++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + j * stride + d), a0);
        _mm256_storeu_ps(acc + d, a0);
    }
#endif
    for (; d < n; d++)
        for (int64_t j = 0; j < tokens; j++) acc[d] += w[j] * v[j * stride + d];
}

/* FP8 pools (engine/kv_quant.py): one float8 byte per element, e4m3fn (fmt 1) or e5m2 (fmt 2).
 * A byte placed in a half's bit pattern is its value exactly, times 2^-8 for e4m3 (its exponent
 * bias is 7 against the half's 15; subnormals land on the half's subnormals or normals, also
 * exactly) and times 1 for e5m2 (the half's top byte): the caller folds that factor into the
 * scales. Stored bytes are never NaN (the writer clamps to the finite range). */
#if defined(__F16C__) && PD_AVX2
#define PD_F16C 1
#else
#define PD_F16C 0
#endif

static inline float fp8_scalar(uint8_t b, int fmt) {
    float v;
    if (fmt == 1) {
        int e = (b >> 3) & 0xF, m = b & 7;
        v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        v = ldexpf(v, -8);
    } else {
        int e = (b >> 2) & 0x1F, m = b & 3;
        v = e ? ldexpf(1.0f + m / 4.0f, e - 15) : ldexpf(m / 4.0f, -14);
    }
    return (b & 0x80) ? -v : v;
}

/* dst[t][0:n] = the float8 row src + t * stride (bytes), for t < tokens, before the caller's factor. */
static inline void fp8_rows(float *dst, const uint8_t *src, int64_t stride, int64_t tokens, int64_t n, int fmt) {
    for (int64_t t = 0; t < tokens; t++) {
        const uint8_t *r = src + t * stride;
        float *o = dst + t * n;
        int64_t d = 0;
#if PD_F16C
        const __m128i sign = _mm_set1_epi16(0x80), mag = _mm_set1_epi16(0x7f);
        for (; d + 8 <= n; d += 8) {
            __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(r + d)));
            __m128i h = fmt == 1 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, sign), 8),
                                                _mm_slli_epi16(_mm_and_si128(w, mag), 7))
                                 : _mm_slli_epi16(w, 8);
            _mm256_storeu_ps(o + d, _mm256_cvtph_ps(h));
        }
#endif
        for (; d < n; d++) o[d] = fp8_scalar(r[d], fmt);
    }
}

/* fmt 0: kv is float32 (strides in floats); 1, 2: float8 (strides in bytes), with each KV head's
 * factors k_scales[h], v_scales[h] (the layer's scales times the format's factor above). */
static int paged_decode(const float *q, int64_t q_stride, const void *kv, float *out,
                        const int64_t *qidx, const int32_t *lens, const int32_t *tables,
                        int64_t max_blocks, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        float scale, int64_t max_len, int num_threads, int64_t tok_stride,
                        int64_t head_stride, int fmt, const float *k_scales, const float *v_scales) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t half = block_size * num_kv_heads * head_dim; /* the K (or V) half of a block */
    const int64_t items = num_seqs * num_kv_heads;
    const int64_t unpacked = fmt ? block_size * head_dim : 0;   /* one block of one head, as floats */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * max_len + group * head_dim + group + unpacked));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *acc = scores + group * max_len;
        float *rows = acc + group * head_dim + group;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (scores == NULL) continue;
            const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            const int64_t len = lens[i];
            const int32_t *table = tables + i * max_blocks;
            const float *qh = q + qidx[i] * q_stride + h * group * head_dim;
            const int64_t nblk = (len + block_size - 1) / block_size;
            const float sk = fmt ? scale * k_scales[h] : scale, sv = fmt ? v_scales[h] : 1.0f;
            /* where block b's K (part 0) or V (part 1) rows of head h are, and their stride */
#define PD_ROWS(b, part, n, out_rows, out_row)                                                           \
            do {                                                                                         \
                const int64_t at = ((int64_t)table[b] * 2 + (part)) * half + h * head_stride;            \
                if (fmt) {                                                                               \
                    fp8_rows(rows, (const uint8_t *)kv + at, tok_stride, (n), head_dim, fmt);            \
                    out_rows = rows; out_row = head_dim;                                                 \
                } else {                                                                                 \
                    out_rows = (const float *)kv + at; out_row = tok_stride;                             \
                }                                                                                        \
            } while (0)
            /* scores[g][t] = scale * q_g . K_t, block by block */
            for (int64_t b = 0; b < nblk; b++) {
                const int64_t t0 = b * block_size;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                const float *kb;
                int64_t row;
                PD_ROWS(b, 0, n, kb, row);
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * head_dim;
                    float *s = scores + g * max_len + t0;
                    int64_t j = 0;
#if PD_AVX2
                    if (head_dim % 8 == 0)
                        for (; j + 8 <= n; j += 8)
                            _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_set1_ps(sk), dot8(qg, kb + j * row, row, head_dim)));
#endif
                    for (; j < n; j++) s[j] = sk * dot(qg, kb + j * row, head_dim);
                }
            }
            float *invp = acc + group * head_dim;
            for (int64_t g = 0; g < group; g++) invp[g] = sv / softmax_unnormalised(scores + g * max_len, len);
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
            for (int64_t b = 0; b < nblk; b++) {
                const int64_t t0 = b * block_size;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                const float *vb;
                int64_t row;
                PD_ROWS(b, 1, n, vb, row);
                for (int64_t g = 0; g < group; g++)
                    accumulate_block(acc + g * head_dim, scores + g * max_len + t0, vb, row, n, head_dim);
            }
#undef PD_ROWS
            for (int64_t g = 0; g < group; g++) {
                float *o = out + (qidx[i] * num_heads + h * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] = acc[g * head_dim + d] * invp[g];
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

int pdserve_paged_decode_f32(const float *q, int64_t q_stride, const float *kv, float *out,
                             const int64_t *qidx, const int32_t *lens, const int32_t *tables,
                             int64_t max_blocks, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, int64_t max_len, int num_threads, int64_t tok_stride,
                             int64_t head_stride) {
    return paged_decode(q, q_stride, kv, out, qidx, lens, tables, max_blocks, num_seqs, num_heads, num_kv_heads,
                        head_dim, block_size, scale, max_len, num_threads, tok_stride, head_stride, 0, NULL, NULL);
}

/* The same over a float8 pool: strides in bytes, fmt 1 (e4m3fn) or 2 (e5m2), per-KV-head factors. */
int pdserve_paged_decode_fp8(const float *q, int64_t q_stride, const uint8_t *kv, float *out,
                             const int64_t *qidx, const int32_t *lens, const int32_t *tables,
                             int64_t max_blocks, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, int64_t max_len, int num_threads, int64_t tok_stride,
                             int64_t head_stride, int fmt, const float *k_scales, const float *v_scales) {
    if (fmt != 1 && fmt != 2) return -2;
    return paged_decode(q, q_stride, kv, out, qidx, lens, tables, max_blocks, num_seqs, num_heads, num_kv_heads,
                        head_dim, block_size, scale, max_len, num_threads, tok_stride, head_stride, fmt,
                        k_scales, v_scales);
}
