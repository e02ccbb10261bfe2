/* A depthwise causal convolution over one sequence's window [its conv state row | its inputs],
   on the CPU in float32. Shared by causal_conv.c and mamba2_rows.c.

   The state row S is (C, K-1) (channel-major, as the pool holds it); `conv_head` transposes it
   to (K-1, C) so that every tap is a vector operation across the channels. Input t's C channels
   lie contiguous at x + t * x_tok. */
#ifndef HYRAX_CONV_WINDOW_H
#define HYRAX_CONV_WINDOW_H
#include <stdint.h>

static inline void conv_head(float *restrict head, const float *restrict S, int64_t C, int64_t keep) {
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < keep; j++)
            head[j * C + c] = S[c * keep + j];
}

/* window position `at` (0 .. keep-1 the state, then the inputs) as a row of C channels */
static inline const float *conv_at(const float *head, const float *x, int64_t x_tok, int64_t at, int64_t C,
                                   int64_t keep) {
    return at < keep ? head + at * C : x + (at - keep) * x_tok;
}

/* out[t, c] = sum_k taps[k][c] w(t + k)[c] + bias[c] for t < T, the taps added in order
   k = 0 .. K-1 and then the bias (the order torch's path adds them in); out: (T, C) */
static inline void conv_window(float *restrict out, const float *head, const float *x, int64_t x_tok,
                               const float *restrict taps, const float *restrict bias, int64_t T, int64_t C,
                               int64_t K) {
    const int64_t keep = K - 1;
    for (int64_t t = 0; t < T; t++) {
        float *restrict o = out + t * C;
        for (int64_t k = 0; k < K; k++) {
            const float *restrict w = conv_at(head, x, x_tok, t + k, C, keep);
            const float *restrict tap = taps + k * C;
            if (k == 0)
                for (int64_t c = 0; c < C; c++)
                    o[c] = w[c] * tap[c];
            else
                for (int64_t c = 0; c < C; c++)
                    o[c] += w[c] * tap[c];
        }
        if (bias)
            for (int64_t c = 0; c < C; c++)
                o[c] += bias[c];
    }
}

/* the state row after the sequence's first q inputs: window positions q .. q + K - 2 */
static inline void conv_keep(float *restrict S, const float *head, const float *x, int64_t x_tok, int64_t q,
                             int64_t C, int64_t keep) {
    for (int64_t j = 0; j < keep; j++) {
        const float *restrict w = conv_at(head, x, x_tok, q + j, C, keep);
        for (int64_t c = 0; c < C; c++)
            S[c * keep + j] = w[c];
    }
}

#endif
