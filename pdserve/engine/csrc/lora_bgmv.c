/* LoRA deltas of a step's rows, each row against its own adapter only (engine/lora_layers.py).
 *
 * For every row t whose slot s = slots[t] is >= 0 (-1: the base model, left alone):
 *
 *     h = scalings[s] * A_s x_t              (ranks[s] values; A_s = a[s, :ranks[s], :])
 *     y[t, c0 + o] += sum_j B_s[o, j] h[j]   (o < out; B_s[o, j] = bt[s, j, o])
 *
 * which is PEFT's base + (B (A x)) * scaling, with the scaling applied to the rank-sized h
 * instead of the output (the same products, summed in another order). The work is the rows'
 * own adapters' only, not every slot's: a gathered matrix-vector product per row (vLLM's
 * punica "BGMV" on GPUs), here over the rows in parallel with OpenMP.
 *
 * Layouts (float32, C order): x [T, in] with row stride xs; a [S, R, in]; bt [S, R, out] (B
 * transposed, so the expand adds whole output rows); y rows
 * of stride ys, the delta added to columns [c0, c0 + out). R is the slots' padded rank (the
 * stack's), ranks[s] <= R the adapter's own.
 */

#include <stdint.h>

int pdserve_lora_bgmv_f32(const float *x, int64_t xs, int64_t T, int64_t in,
                          const float *a, const float *bt, int64_t S, int64_t R, int64_t out,
                          const int32_t *slots, const int32_t *ranks, const float *scalings,
                          float *y, int64_t ys, int64_t c0, int nthreads) {
    if (R > 512) return 1; /* h lives on the stack */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int32_t s = slots[t];
        if (s < 0 || s >= S) continue;
        int64_t r = ranks[s];
        if (r <= 0) continue;
        float h[512];
        const float *xt = x + t * xs;
        const float *as = a + (int64_t)s * R * in;
        float scale = scalings[s];
        for (int64_t j = 0; j < r; j++) {
            const float *aj = as + j * in;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < in; i++) acc += aj[i] * xt[i];
            h[j] = acc * scale;
        }
        float *yt = y + t * ys + c0;
        const float *bs = bt + (int64_t)s * R * out;
        for (int64_t j = 0; j < r; j++) {
            const float *bj = bs + j * out;
            float hj = h[j];
#pragma omp simd
            for (int64_t o = 0; o < out; o++) yt[o] += hj * bj[o];
        }
    }
    return 0;
}
