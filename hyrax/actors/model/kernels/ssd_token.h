/* One token of the Mamba2 SSD recurrence for one (sequence, head), on a state kept transposed
   as (N, P) in a scratch: the update and the readout run along P in vectors, the readout sums
   over N one term at a time (a fixed order). Shared by ssd_scan.c and mamba2_rows.c. */
#ifndef HYRAX_SSD_TOKEN_H
#define HYRAX_SSD_TOKEN_H
#include <stdint.h>

static inline void to_np(float *restrict st, const float *restrict s, int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; p++)
        for (int64_t n = 0; n < N; n++)
            st[n * P + p] = s[p * N + n];
}

static inline void to_pn(float *restrict s, const float *restrict st, int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; p++)
        for (int64_t n = 0; n < N; n++)
            s[p * N + n] = st[n * P + p];
}

/* one token of one (sequence, head): the state (N, P) in st advanced, y written */
static inline __attribute__((always_inline)) void advance(float *restrict st, float *restrict u, float *restrict acc,
                                                          const float *restrict xt, const float *restrict bn,
                                                          const float *restrict cn, float *restrict yt, float step,
                                                          float decay, float dh, int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; p++) {
        u[p] = step * xt[p];
        acc[p] = 0.0f;
    }
    for (int64_t n = 0; n < N; n++) {
        float *restrict row = st + n * P;
        const float bv = bn[n], cv = cn[n];
        for (int64_t p = 0; p < P; p++) {
            row[p] = row[p] * decay + u[p] * bv;
            acc[p] += row[p] * cv;
        }
    }
    for (int64_t p = 0; p < P; p++)
        yt[p] = acc[p] + dh * xt[p];
}

/* `advance` with P = 32 or 64 as a constant where it is one (half the time of a runtime P) */
static inline void advance_any(float *restrict st, float *restrict u, float *restrict acc, const float *restrict xt,
                               const float *restrict bn, const float *restrict cn, float *restrict yt, float step,
                               float decay, float dh, int64_t P, int64_t N) {
    if (P == 32)
        advance(st, u, acc, xt, bn, cn, yt, step, decay, dh, 32, N);
    else if (P == 64)
        advance(st, u, acc, xt, bn, cn, yt, step, decay, dh, 64, N);
    else
        advance(st, u, acc, xt, bn, cn, yt, step, decay, dh, P, N);
}

#endif
