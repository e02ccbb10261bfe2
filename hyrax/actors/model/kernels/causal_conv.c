/* The depthwise causal convolution of a Mamba2 layer over a step, on the pool's conv state
   rows in place (float32, CPU).

   Sequence b's window is its state row pool[rows[b]] ((C, K-1): the K-1 inputs before the
   step) followed by its T inputs x[b, t, :]. out[b, t, c] = sum_k taps[k][c] w_c(t + k) +
   bias[c], the taps added in order k = 0 .. K-1, then the bias (the order torch's path adds
   them in). The row is left holding the K-1 inputs that end at token q_lens[b] - 1 (the
   padding after it is not part of the window). x: token t of sequence b at
   x + b * x_seq + t * x_tok, its C channels contiguous.

   Returns 0, or -1 when a row lies outside the pool (nothing is written then), -3 when the
   scratch cannot be allocated, -4 when two sequences share a row (nothing written). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conv_window.h"
#include "rows.h"

int hyrax_causal_conv_f32(float *pool, int64_t pool_rows, const int64_t *rows, const float *x, int64_t x_seq,
                          int64_t x_tok, const int64_t *q_lens, const float *taps, const float *bias, float *out,
                          int64_t B, int64_t T, int64_t C, int64_t K) {
    if (!in_pool(rows, B, pool_rows))
        return -1;
    if (!distinct(rows, B))
        return -4;
    const int64_t keep = K - 1;
    /* the window's first K-1 inputs, transposed to (K-1, C) so that channels are contiguous */
    float *head = malloc(sizeof(float) * (size_t)((keep > 0 ? keep : 1) * C));
    if (!head)
        return -3;
    for (int64_t b = 0; b < B; b++) {
        float *S = pool + rows[b] * C * keep;
        const float *xb = x + b * x_seq;
        conv_head(head, S, C, keep);
        conv_window(out + b * T * C, head, xb, x_tok, taps, bias, T, C, K);
        conv_keep(S, head, xb, x_tok, q_lens[b], C, keep);
    }
    free(head);
    return 0;
}
