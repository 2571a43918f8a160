/*
 * Causal attention of one prompt (or one chunk of it) on the CPU, float32: flash-style (online
 * softmax), tiled so that each K and V row read from cache serves a tile of query rows.
 *
 * Query row t is the prompt's token q_offset + t (q_offset: the tokens before the chunk, 0 for
 * a fresh prompt) and attends keys 0 .. q_offset + t. torch's CPU SDPA (its flash kernel)
 * reaches about a quarter of an AVX-512 core's multiply-add rate on head_dim 64; this kernel keeps a tile of 8 query rows of one head in registers against 32
 * keys at a time: the scores as 8 x 32 multiply-adds per K^T row loaded (two vectors), then the
 * weighted V rows as 8 x 16 per V row loaded. The softmax's bookkeeping per row (the block's
 * maximum, the rescale, the sum: horizontal reductions) is paid once per 32 keys instead of
 * once per 16 (950 tokens, 6/2 heads, 2 Zen 4 cores: 4.4 ms against 5.1).
 *
 * Layouts (engine/prefill_native.py prepares them):
 *   q    [T][num_heads][head_dim], row stride q_row floats (a view into qkv)
 *   kt   [num_kv_heads][head_dim][t_pad]: K of the q_offset + T keys transposed per KV head,
 *        t_pad a multiple of 16 (the padding is never a key: the causal mask ends every row first)
 *   v    [q_offset + T][num_kv_heads][head_dim], row stride v_row floats
 *   out  [T][num_heads][head_dim], row stride out_row floats
 * Query head j reads KV head j / (num_heads / num_kv_heads), as HF's repeat_kv does. Softmax
 * in float32 with the running maximum (flash attention's rescaling); every row attends at
 * least itself, so no row's weights are all zero. Work items are (tile of 8 rows, query head),
 * longest tiles first, over OpenMP threads; built and loaded by engine/native.py.
 *
 * The vector path needs AVX-512F and head_dim a multiple of 16 (`pdserve_prefill_attn_ok`);
 * the caller keeps SDPA otherwise.
 */
#include "exp_poly.h"
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PA_AVX512 1
#else
#define PA_AVX512 0
#endif

#define ROWS 8    /* query rows per tile */
#define KEYS 32   /* keys per step: two 512-bit vectors of scores */
#define MAX_DIM 256

int pdserve_prefill_attn_ok(int64_t head_dim) {
    return PA_AVX512 && head_dim % 16 == 0 && head_dim <= MAX_DIM;
}

#if PA_AVX512
/* exp(x) for x <= 0 (after the running maximum is subtracted): exp_poly.h's polynomial, 16
 * lanes (csrc/paged_decode.c has the 8-lane AVX2 form). */
static inline __m512 exp_nonpos512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n); /* p x 2^n in one instruction (the same value as building 2^n's bits) */
}

/* The lanes of a vector of 16 keys that a row seeing ``see`` of them attends (0: none). */
static inline __mmask16 see_mask(int64_t see) {
    return (__mmask16)(see >= 16 ? 0xFFFF : see <= 0 ? 0 : ((1u << see) - 1u));
}

/* One tile: rows i0 .. i0 + n - 1 (n <= ROWS) of query head hq against KV head h. */
static void tile(const float *q, int64_t q_row, const float *kt, const float *v, int64_t v_row, float *out,
                 int64_t out_row, int64_t i0, int64_t n, int64_t hq, int64_t h, int64_t head_dim,
                 int64_t t_pad, float scale, int64_t q_offset) {
    float acc[ROWS][MAX_DIM] __attribute__((aligned(64)));
    float p[ROWS][KEYS] __attribute__((aligned(64)));
    float m[ROWS], l[ROWS];
    const float *qr[ROWS];
    for (int64_t r = 0; r < ROWS; r++) {
        /* rows past n repeat the last one (computed, never stored): the loops stay fixed */
        qr[r] = q + (i0 + (r < n ? r : n - 1)) * q_row + hq * head_dim;
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) acc[r][d] = 0.0f;
    }
    const float *kth = kt + h * head_dim * t_pad;
    const float *vh = v + h * head_dim;
    const int64_t last = q_offset + i0 + n - 1; /* the tile's last row attends keys 0..last */
    const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 <= last; j0 += KEYS) {
        const int64_t keys = last - j0 + 1 < KEYS ? last - j0 + 1 : KEYS; /* keys any row of the tile sees */
        __m512 s0[ROWS], s1[ROWS];
        for (int r = 0; r < ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();
        if (keys > 16) {
            for (int64_t d = 0; d < head_dim; d++) {
                const __m512 k0 = _mm512_loadu_ps(kth + d * t_pad + j0);
                const __m512 k1 = _mm512_loadu_ps(kth + d * t_pad + j0 + 16);
                for (int r = 0; r < ROWS; r++) {
                    const __m512 qd = _mm512_set1_ps(qr[r][d]);
                    s0[r] = _mm512_fmadd_ps(qd, k0, s0[r]);
                    s1[r] = _mm512_fmadd_ps(qd, k1, s1[r]);
                }
            }
        } else { /* the diagonal's last block: one vector of keys */
            for (int64_t d = 0; d < head_dim; d++) {
                const __m512 k0 = _mm512_loadu_ps(kth + d * t_pad + j0);
                for (int r = 0; r < ROWS; r++) s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k0, s0[r]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            const int64_t pos = q_offset + i0 + (r < n ? r : n - 1);
            const int64_t see = pos - j0 + 1; /* keys of this block row r attends */
            if (see <= 0) {
                _mm512_store_ps(p[r], _mm512_setzero_ps());
                _mm512_store_ps(p[r] + 16, _mm512_setzero_ps());
                continue;
            }
            const __mmask16 mask0 = see_mask(see), mask1 = see_mask(see - 16);
            const __m512 sr0 = _mm512_mul_ps(s0[r], vscale);
            const __m512 sr1 = _mm512_mul_ps(s1[r], vscale);
            __m512 mv = _mm512_mask_mov_ps(neg_inf, mask0, sr0);
            mv = _mm512_mask_max_ps(mv, mask1, mv, sr1);
            const float mx = _mm512_reduce_max_ps(mv);
            const float m_new = mx > m[r] ? mx : m[r];
            const __m512 mn = _mm512_set1_ps(m_new);
            const __m512 e0 = _mm512_maskz_mov_ps(mask0, exp_nonpos512(_mm512_sub_ps(sr0, mn)));
            const __m512 e1 = mask1 ? _mm512_maskz_mov_ps(mask1, exp_nonpos512(_mm512_sub_ps(sr1, mn)))
                                    : _mm512_setzero_ps();
            _mm512_store_ps(p[r], e0);
            _mm512_store_ps(p[r] + 16, e1);
            const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
            if (alpha != 1.0f) {
                const __m512 a = _mm512_set1_ps(alpha);
                for (int64_t d = 0; d < head_dim; d += 16)
                    _mm512_store_ps(acc[r] + d, _mm512_mul_ps(a, _mm512_load_ps(acc[r] + d)));
            }
            m[r] = m_new;
        }
        for (int64_t d = 0; d < head_dim; d += 16) {
            __m512 a[ROWS];
            for (int r = 0; r < ROWS; r++) a[r] = _mm512_load_ps(acc[r] + d);
            for (int64_t j = 0; j < keys; j++) {
                const __m512 vv = _mm512_loadu_ps(vh + (j0 + j) * v_row + d);
                for (int r = 0; r < ROWS; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), vv, a[r]);
            }
            for (int r = 0; r < ROWS; r++) _mm512_store_ps(acc[r] + d, a[r]);
        }
    }
    for (int64_t r = 0; r < n; r++) {
        float *o = out + (i0 + r) * out_row + hq * head_dim;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(inv, _mm512_load_ps(acc[r] + d)));
    }
}
#endif

/* Returns 0, or -1 when the vector path is not there for these shapes (nothing written). */
int pdserve_prefill_attn_f32(const float *q, int64_t q_row, const float *kt, const float *v, int64_t v_row,
                             float *out, int64_t out_row, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t t_pad, float scale, int num_threads, int64_t q_offset) {
    if (!pdserve_prefill_attn_ok(head_dim) || num_heads % num_kv_heads != 0 || q_offset < 0 || t_pad < q_offset + T ||
        t_pad % KEYS != 0)
        return -1;
#if PA_AVX512
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tiles = (T + ROWS - 1) / ROWS;
    const int64_t items = tiles * num_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t t = tiles - 1 - item / num_heads; /* the longest tiles first */
        const int64_t hq = item % num_heads;
        const int64_t i0 = t * ROWS;
        const int64_t n = T - i0 < ROWS ? T - i0 : ROWS;
        tile(q, q_row, kt, v, v_row, out, out_row, i0, n, hq, hq / group, head_dim, t_pad, scale, q_offset);
    }
    return 0;
#else
    (void)q; (void)q_row; (void)kt; (void)v; (void)v_row; (void)out; (void)out_row; (void)num_threads; (void)scale;
    (void)q_offset;
    return -1;
#endif
}
