/* A structured output's token mask applied to the step's logits (engine/structured_state.py):
 * every token whose bit is clear in its row of the bitmask gets -inf. The bitmask is
 * xgrammar's: int32 words, bit j of word w allowing token 32 w + j. Only the words with a clear
 * bit are touched: a word of all ones (32 tokens allowed, the common case inside a JSON
 * string) costs one compare, a word of all zeros 32 stores. Rows go to OpenMP threads (torch's
 * pool: libgomp is shared, engine/native.py).
 */
#include <math.h>
#include <stdint.h>

void pdserve_apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask,
                                     int64_t words_stride, const int64_t *rows, int64_t n, int64_t vocab) {
    const int64_t words = (vocab + 31) / 32;
#pragma omp parallel for schedule(static) if (n > 8)
    for (int64_t j = 0; j < n; j++) {
        float *row = logits + rows[j] * logits_stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + rows[j] * words_stride);
        for (int64_t w = 0; w < words; w++) {
            uint32_t off = ~bits[w];
            if (off == 0) continue;
            const int64_t base = w * 32;
            if (off == 0xFFFFFFFFu && base + 32 <= vocab) {
                for (int k = 0; k < 32; k++) row[base + k] = -INFINITY;
                continue;
            }
            while (off) {
                const int64_t tok = base + __builtin_ctz(off);
                if (tok < vocab) row[tok] = -INFINITY;
                off &= off - 1;
            }
        }
    }
}
