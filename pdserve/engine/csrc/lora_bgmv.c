/* LoRA deltas of a step's rows, each row against its own adapter only (engine/lora_layers.py).
 *
 * One call covers every part of a (possibly fused) projection: q, k and v of qkv_proj, gate
 * and up of gate_up_proj, or the single part of o_proj and down_proj. For every row t whose
 * slot s = slots[t] is >= 0 (-1: the base model, left alone) and every part p the adapter
 * has (present[s * P + p]):
 *
 *     h = scalings[s] * A_sp x_t                  (ranks[s] values; A_sp = a[s, p, :ranks[s], :])
 *     y[t, c0[p] + o] += sum_j B_sp[o, j] h[j]    (o < outs[p]; B_sp[o, j] = bt_p[s, j, o])
 *
 * which is PEFT's base + (B (A x)) * scaling, with the scaling applied to the rank-sized h
 * instead of the output (the same products, summed in another order). The work is the rows'
 * own adapters' only, not every slot's: a gathered matrix-vector product per row (vLLM's
 * punica "BGMV" on GPUs; with the rows of an adapter taken together, its "SGMV"), here in
 * parallel with OpenMP. The parts share the rows' x (read once, while it is in cache) and one
 * parallel region: one call per projection instead of one per part.
 *
 * Layouts (float32, C order): x [T, in] with row stride xs; a [S, P, R, in] (the parts' A's
 * side by side per slot); part p's B transposed, bt_p [S, R, outs[p]], at bt + boffs[p]
 * (so the expand adds whole output rows); y rows of stride ys. R is the slots' padded rank
 * (the stacks'), ranks[s] <= R the adapter's own.
 */

#include <stdint.h>
#include <string.h>

#define MAX_RANK 512
#define MAX_CHUNK 8

/* 16 floats (one AVX-512 register; GCC lowers the type to whatever the machine has, e.g.
 * four NEON registers), loaded and stored unaligned. */
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline float hsum16(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* h[j] = scale * (A_j . x) for j < r: four A rows at a time (four independent sums, x read
 * once for the four), the tail of `in` past a multiple of 16 added one by one. */
static void shrink(const float *as, int64_t in, int64_t r, const float *x, float scale, float *h) {
    int64_t iv = in & ~(int64_t)15;
    int64_t j = 0;
    for (; j + 4 <= r; j += 4) {
        const float *a0 = as + j * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
        v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int64_t i = 0; i < iv; i += 16) {
            v16 xv = load16(x + i);
            s0 += load16(a0 + i) * xv;
            s1 += load16(a1 + i) * xv;
            s2 += load16(a2 + i) * xv;
            s3 += load16(a3 + i) * xv;
        }
        float t0 = hsum16(s0), t1 = hsum16(s1), t2 = hsum16(s2), t3 = hsum16(s3);
        for (int64_t i = iv; i < in; i++) {
            t0 += a0[i] * x[i];
            t1 += a1[i] * x[i];
            t2 += a2[i] * x[i];
            t3 += a3[i] * x[i];
        }
        h[j] = t0 * scale;
        h[j + 1] = t1 * scale;
        h[j + 2] = t2 * scale;
        h[j + 3] = t3 * scale;
    }
    for (; j < r; j++) {
        const float *aj = as + j * in;
        v16 s0 = {0};
        for (int64_t i = 0; i < iv; i += 16) s0 += load16(aj + i) * load16(x + i);
        float t = hsum16(s0);
        for (int64_t i = iv; i < in; i++) t += aj[i] * x[i];
        h[j] = t * scale;
    }
}

/* y[o] += sum_j h[j] bt[j, o] for o < out: 64 outputs at a time kept in four registers over
 * the whole rank (each y value loaded and stored once), then 16 at a time, then one by one. */
static void expand(const float *bs, int64_t out, int64_t r, const float *h, float *y) {
    int64_t o = 0;
    for (; o + 64 <= out; o += 64) {
        v16 y0 = load16(y + o), y1 = load16(y + o + 16), y2 = load16(y + o + 32), y3 = load16(y + o + 48);
        for (int64_t j = 0; j < r; j++) {
            const float *bj = bs + j * out + o;
            float hj = h[j];
            y0 += hj * load16(bj);
            y1 += hj * load16(bj + 16);
            y2 += hj * load16(bj + 32);
            y3 += hj * load16(bj + 48);
        }
        store16(y + o, y0);
        store16(y + o + 16, y1);
        store16(y + o + 32, y2);
        store16(y + o + 48, y3);
    }
    for (; o + 16 <= out; o += 16) {
        v16 y0 = load16(y + o);
        for (int64_t j = 0; j < r; j++) y0 += h[j] * load16(bs + j * out + o);
        store16(y + o, y0);
    }
    for (; o < out; o++) {
        float acc = y[o];
        for (int64_t j = 0; j < r; j++) acc += h[j] * bs[j * out + o];
        y[o] = acc;
    }
}

/* Rows are visited in chunks of at most MAX_CHUNK rows of one slot (order[chunks[2c] ..
 * chunks[2c + 1]) are the rows of chunk c, all of slot slots[order[...]]): each row of an
 * adapter's A and B is read once per chunk and used for every row of it, so a step with n
 * rows on one adapter reads its weights ceil(n / MAX_CHUNK) times, not n times (the adapters'
 * weights, not the arithmetic, are what a small model's step waits for). Chunks are spread over
 * the threads; no two write the same row. */
int pdserve_lora_bgmv_f32(const float *x, int64_t xs, int64_t in,
                          const float *a, const float *bt, int64_t S, int64_t R, int64_t P,
                          const int64_t *outs, const int64_t *c0s, const int64_t *boffs,
                          const uint8_t *present, const int32_t *slots, const int32_t *order,
                          const int32_t *chunks, int64_t nchunks, const int32_t *ranks,
                          const float *scalings, float *y, int64_t ys, int nthreads) {
    if (R > MAX_RANK) return 1; /* h lives on the stack */
    for (int64_t c = 0; c < nchunks; c++)
        if (chunks[2 * c + 1] - chunks[2 * c] > MAX_CHUNK || chunks[2 * c + 1] <= chunks[2 * c]) return 2;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t c = 0; c < nchunks; c++) {
        const int32_t *rows = order + chunks[2 * c];
        int64_t m = chunks[2 * c + 1] - chunks[2 * c];
        int32_t s = slots[rows[0]];
        if (s < 0 || s >= S) continue;
        int64_t r = ranks[s];
        if (r <= 0) continue;
        float h[MAX_CHUNK][MAX_RANK];
        const float *xr[MAX_CHUNK];
        float *yr[MAX_CHUNK];
        for (int64_t k = 0; k < m; k++) {
            xr[k] = x + (int64_t)rows[k] * xs;
            yr[k] = y + (int64_t)rows[k] * ys;
        }
        float scale = scalings[s];
        for (int64_t p = 0; p < P; p++) {
            if (!present[s * P + p]) continue;
            const float *as = a + ((int64_t)s * P + p) * R * in;
            const float *bs = bt + boffs[p] + (int64_t)s * R * outs[p];
            /* the chunk's rows against this part's A, then its B: both stay in cache across
             * the chunk's rows */
            for (int64_t k = 0; k < m; k++) shrink(as, in, r, xr[k], scale, h[k]);
            for (int64_t k = 0; k < m; k++) expand(bs, outs[p], r, h[k], yr[k] + c0s[p]);
        }
    }
    return 0;
}
