/* exp(x) for x <= 0, as the attention kernels compute softmax weights after the running
 * maximum is subtracted (csrc/paged_decode.c with AVX2, csrc/prefill_attn.c with AVX-512):
 * Cephes' expf. Range reduction x = n ln2 + r with ln2 split in two (a high part exact in
 * float, a low correction), then exp(r) = 1 + r + r^2 (P0 r^5 + P1 r^4 + ... + P5): about
 * 1 ulp. Below EXP_MIN the result underflows; the kernels clamp there first. */

#ifndef PDSERVE_EXP_POLY_H
#define PDSERVE_EXP_POLY_H

#define EXP_MIN (-87.3f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500E-4f
#define EXP_P1 1.3981999507E-3f
#define EXP_P2 8.3334519073E-3f
#define EXP_P3 4.1665795894E-2f
#define EXP_P4 1.6666665459E-1f
#define EXP_P5 5.0000001201E-1f

#endif
