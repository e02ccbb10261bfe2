/* The Mamba2 SSD recurrence over a prefill step, token by token, on pool rows in place
   (float32, CPU).

   For sequence b, head h (group g = h / (H / G)), token t:
       S = exp(dt[b,t,h] A[h]) S + dt[b,t,h] x[b,t,h,:] (outer) Bm[b,t,g,:]
       y[b,t,h,:] = S . Cm[b,t,g,:] + D[h] x[b,t,h,:]
   where S (P, N) starts as pool row rows[b] and is left there after the last token. A token
   with dt = 0 (padding) leaves S as it is. Captures: the state of sequence cap_seq[i] after its
   first cap_len[i] tokens is copied to cap_out[i] (P*N floats per head, H heads).

   Each (sequence, head) state is carried through every token in a scratch copy laid out (N, P),
   transposed from the pool's (P, N), while it stays in the core's first-level cache: then both
   the update and the readout run along P in vectors, and the readout sums over N one term at a
   time (a fixed order, the same whatever else shares the step) with no horizontal sums.

   Returns 0, or -1 when a pool row lies outside the pool (nothing is written then), -3 when
   the scratch cannot be allocated, -4 when two sequences share a row (nothing written). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"
#include "ssd_token.h"

int hyrax_ssd_scan_f32(float *pool, int64_t pool_rows, const int64_t *rows, const float *x, const float *dt,
                       const float *A, const float *Bm, const float *Cm, const float *D, float *y, int64_t B,
                       int64_t T, int64_t H, int64_t G, int64_t P, int64_t N, int64_t n_cap, const int64_t *cap_seq,
                       const int64_t *cap_len, float *cap_out) {
    if (!in_pool(rows, B, pool_rows))
        return -1;
    if (!distinct(rows, B))
        return -4;
    float *st = malloc(sizeof(float) * (size_t)(N * P + 2 * P));
    if (!st)
        return -3;
    float *u = st + N * P, *acc = u + P;
    const int64_t R = H / G;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / R;
            float *S = pool + (rows[b] * H + h) * P * N;
            to_np(st, S, P, N);
            const float a = A[h], dh = D[h];
            for (int64_t t = 0; t < T; t++) {
                const int64_t bt = b * T + t;
                const float step = dt[bt * H + h];
                const float *restrict xt = x + (bt * H + h) * P;
                const float *restrict bn = Bm + (bt * G + g) * N;
                const float *restrict cn = Cm + (bt * G + g) * N;
                float *restrict yt = y + (bt * H + h) * P;
                const float decay = expf(fmaxf(step * a, -80.0f)); /* ssd.LOG_DECAY_FLOOR */
                advance_any(st, u, acc, xt, bn, cn, yt, step, decay, dh, P, N);
                for (int64_t i = 0; i < n_cap; i++)
                    if (cap_seq[i] == b && cap_len[i] == t + 1)
                        to_pn(cap_out + (i * H + h) * P * N, st, P, N);
            }
            to_pn(S, st, P, N);
        }
    }
    free(st);
    return 0;
}
