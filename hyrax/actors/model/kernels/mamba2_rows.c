/* A Mamba2 layer's step from in_proj's output to the input of out_proj, on the pool's state
   rows in place (float32, CPU): one decode token per sequence (hyrax_mamba2_decode_f32), or a
   prefill step's tokens (hyrax_mamba2_prefill_f32, at the end of this file).

   Per sequence b, from its in_proj row zxbcdt[b] = [z (H*P) | xBC (C) | dt (H)], C = H*P + 2*G*N:
     1. causal conv: w = [conv state row (C, K-1) | xBC]; u[c] = silu(sum_k taps[k][c] w[c][k]
        + bias[c]) (taps added in order k = 0 .. K-1, then the bias); the row keeps w[c][1 ..].
        u = [x (H*P) | B (G*N) | C (G*N)].
     2. per head h (group g = h / (H/G)): dt = softplus(dt_raw + dt_bias[h]) (torch's: the input
        itself above 20), clamped to [dt_lo, dt_hi]; decay = exp(dt * A[h]) (the torch path
        floors the exponent at -80, ssd.LOG_DECAY_FLOOR, because torch's exp is slow below -87:
        a difference under 2e-35 in the decay; here it is one libm call per head);
        S = decay * S + (dt * x_h) (outer) B_g on the SSM state row (H, P, N);
        y_h = S . C_g + D[h] * x_h.
     3. the gated norm, per group of `group` channels of y:
        mode 0: h = y * silu(z), out = h / sqrt(mean(h^2) + eps) * weight;
        mode 1: out = y / sqrt(mean(y^2) + eps) * weight * silu(z);
        mode 2: out = y * silu(z) (no norm, no weight).
   out: (B, H*P). Each sequence is computed alone, in a fixed order: its result does not depend
   on what else shares the step.

   The readout sums over N in LANES partial sums, added up in a fixed order at the end, so the
   state update and the readout run in one vectorised pass over the state row.

   Returns 0; before anything is written: -1 when a state row lies outside its pool, -2 for an
   unknown norm mode or a group that does not divide H*P, -3 when the scratch cannot be
   allocated, -4 when two sequences share a state row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conv_window.h"
#include "rows.h"
#include "ssd_token.h"


/* exp(x) to about one unit in the last place (x = k ln2 + r, |r| <= ln2/2, a degree-6
   polynomial for exp(r), then 2^k put in the exponent): branch-free, so that the loops over
   channels that call it run in vectors (libm's expf is a call per element, and the silu of each
   conv channel and gate was most of the kernel's time). Inputs are clamped to where the result
   is a normal float (below: the smallest normal instead of a subnormal); NaN stays NaN. */
static inline float exp_vec(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    x = x > 88.72283f ? 88.72283f : x;
    const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float q = 1.9875691500e-4f;
    q = q * r + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    q = q * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)k + 127) << 23};
    return q * scale.f;
}

static inline float silu(float v) { return v / (1.0f + exp_vec(-v)); }

/* silu of n floats (what the kernel applies, exported for its accuracy test) */
void hyrax_silu_f32(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = silu(x[i]);
}

static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* LANES floats as one value (GCC's vector extension), as wide as the CPU's vectors: 16 with
   512-bit vectors, else 8 (a 16-wide value on a CPU without them compiled to slow code, 8x
   slower here under -mavx2); loaded with memcpy, unaligned */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
typedef float vec4 __attribute__((vector_size(16)));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the sum of a vector's lanes in a fixed order: its 4-lane quarters added first to last, then
   the four lanes pairwise */
static inline float sum_vec(vec v) {
    vec4 c = {0.0f};
    for (int i = 0; i < LANES; i += 4) {
        vec4 q;
        memcpy(&q, (const char *)&v + 4 * i, sizeof q);
        c = i ? c + q : q;
    }
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* dt after softplus (torch's: the input itself above 20), clamped to [lo, hi] (NaN stays) */
static inline float step_size(float raw, float bias, float lo, float hi) {
    float step = softplus(raw + bias);
    if (step < lo)
        step = lo;
    if (step > hi)
        step = hi;
    return step;
}

/* one token's gated norm in place on y (inner channels), z its gate input; gate: scratch */
static void gated_norm(float *restrict y, const float *restrict z, float *restrict gate, const float *restrict norm_w,
                       float eps, int64_t inner, int64_t group, int64_t mode) {
    for (int64_t i = 0; i < inner; i++)
        gate[i] = silu(z[i]);
    if (mode != 1)
        for (int64_t i = 0; i < inner; i++)
            y[i] *= gate[i];
    if (mode == 2)
        return;
    for (int64_t g0 = 0; g0 < inner; g0 += group) {
        float *yg = y + g0;
        const float *wg = norm_w + g0, *sg = gate + g0;
        vec sq = {0.0f};
        int64_t i = 0;
        for (; i + LANES <= group; i += LANES) {
            const vec v = load_vec(yg + i);
            sq += v * v;
        }
        float ss = sum_vec(sq);
        for (; i < group; i++)
            ss += yg[i] * yg[i];
        const float r = 1.0f / sqrtf(ss / (float)group + eps);
        if (mode == 0)
            for (i = 0; i < group; i++)
                yg[i] = yg[i] * r * wg[i];
        else
            for (i = 0; i < group; i++)
                yg[i] = yg[i] * r * wg[i] * sg[i];
    }
}

/* the state rows of one head advanced by one token; y (P) written */
static inline __attribute__((always_inline)) void head_step(float *restrict S, const float *restrict x,
                                                            const float *restrict bn, const float *restrict cn,
                                                            float *restrict y, float step, float decay, float dh,
                                                            int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; p++) {
        float *restrict row = S + p * N;
        const float u = step * x[p];
        vec acc = {0.0f};
        int64_t n = 0;
        for (; n + LANES <= N; n += LANES) {
            const vec s = load_vec(row + n) * decay + u * load_vec(bn + n);
            memcpy(row + n, &s, sizeof s);
            acc += s * load_vec(cn + n);
        }
        float total = sum_vec(acc);
        for (; n < N; n++) {
            const float s = row[n] * decay + u * bn[n];
            row[n] = s;
            total += s * cn[n];
        }
        y[p] = total + dh * x[p];
    }
}

/* the arguments both entry points check before anything is written (codes as above) */
static int check(int64_t conv_slots, const int64_t *conv_rows, int64_t ssm_slots, const int64_t *ssm_rows,
                 const int64_t *starts, const int64_t *q_lens, int64_t n_rows, int64_t inner, int64_t group,
                 int64_t mode, int64_t B) {
    if (mode < 0 || mode > 2 || group <= 0 || inner % group)
        return -2;
    for (int64_t b = 0; b < B; b++) {
        if (conv_rows[b] < 0 || conv_rows[b] >= conv_slots || ssm_rows[b] < 0 || ssm_rows[b] >= ssm_slots)
            return -1;
        if (q_lens && (starts[b] < 0 || q_lens[b] < 1 || starts[b] + q_lens[b] > n_rows))
            return -5;
    }
    if (!distinct(conv_rows, B) || !distinct(ssm_rows, B))
        return -4;
    return 0;
}

int hyrax_mamba2_decode_f32(const float *zxbcdt, int64_t in_stride, float *conv_pool, int64_t conv_slots,
                            const int64_t *conv_rows, const float *taps, const float *conv_bias, int64_t K,
                            float *ssm_pool, int64_t ssm_slots, const int64_t *ssm_rows, const float *dt_bias,
                            const float *A_log, const float *D, float dt_lo, float dt_hi, const float *norm_w,
                            float eps, int64_t group, int64_t mode, float *out, int64_t B, int64_t H, int64_t G,
                            int64_t P, int64_t N) {
    const int64_t inner = H * P, C = inner + 2 * G * N, keep = K - 1, R = H / G;
    const int rc = check(conv_slots, conv_rows, ssm_slots, ssm_rows, NULL, NULL, 0, inner, group, mode, B);
    if (rc)
        return rc;
    float *u = malloc(sizeof(float) * (size_t)(C + inner)), *gate = u ? u + C : NULL;
    if (!u)
        return -3;
    for (int64_t b = 0; b < B; b++) {
        const float *zb = zxbcdt + b * in_stride, *xbc = zb + inner, *dtb = xbc + C;
        float *W = conv_pool + conv_rows[b] * C * keep;
        /* tap by tap across the channels (vectors; the row's (C, K-1) layout read with a stride) */
        for (int64_t c = 0; c < C; c++)
            u[c] = taps[c] * (keep > 0 ? W[c * keep] : xbc[c]);
        for (int64_t k = 1; k < K; k++) {
            const float *tap = taps + k * C;
            if (k < keep)
                for (int64_t c = 0; c < C; c++)
                    u[c] += tap[c] * W[c * keep + k];
            else
                for (int64_t c = 0; c < C; c++)
                    u[c] += tap[c] * xbc[c];
        }
        if (conv_bias)
            for (int64_t c = 0; c < C; c++)
                u[c] += conv_bias[c];
        if (keep > 0) { /* the row moves on by one input: each channel's window shifts left */
            memmove(W, W + 1, sizeof(float) * (size_t)(C * keep - 1));
            for (int64_t c = 0; c < C; c++)
                W[c * keep + keep - 1] = xbc[c];
        }
        for (int64_t c = 0; c < C; c++) /* apart from the loop above, so that it runs in vectors */
            u[c] = silu(u[c]);
        const float *x = u, *Bm = u + inner, *Cm = Bm + G * N;
        float *y = out + b * inner;
        float *S0 = ssm_pool + ssm_rows[b] * H * P * N;
        for (int64_t h = 0; h < H; h++) {
            const float step = step_size(dtb[h], dt_bias[h], dt_lo, dt_hi);
            const float decay = expf(step * -expf(A_log[h]));
            const int64_t g = h / R;
            float *S = S0 + h * P * N;
            const float *xh = x + h * P, *bn = Bm + g * N, *cn = Cm + g * N;
            if (P == 64 && N == 64) /* the same arithmetic, with trip counts the compiler can see */
                head_step(S, xh, bn, cn, y + h * P, step, decay, D[h], 64, 64);
            else if (P == 32 && N == 32)
                head_step(S, xh, bn, cn, y + h * P, step, decay, D[h], 32, 32);
            else if (N == 128)
                head_step(S, xh, bn, cn, y + h * P, step, decay, D[h], P, 128);
            else
                head_step(S, xh, bn, cn, y + h * P, step, decay, D[h], P, N);
        }
        gated_norm(y, zb, gate, norm_w, eps, inner, group, mode);
    }
    free(u);
    return 0;
}

/* A prefill step: sequence b's q_lens[b] tokens are rows starts[b] .. starts[b] + q_lens[b] - 1
   of the step's n_rows token rows (packed back to back, or a padded (B, T) layout with
   starts[b] = b * T), row r's in_proj output at zxbcdt + r * tok_stride and its result at
   out + r * H*P (rows of no sequence are not written). The same layer as the decode step above,
   token by token: the conv over the window [state | inputs] tap by tap across the channels (the
   state's K-1 inputs transposed to (K-1, C) first), then per head the recurrence over the tokens
   with the state transposed to (N, P) in a scratch (ssd_token.h, as the prefill scan runs it),
   then each token's gated norm. The conv row is left holding the last K-1 inputs of the
   sequence, the SSM row its state after its last token. Returns as the decode step, and -5 when
   a sequence's rows lie outside 0 .. n_rows - 1 (or it has none). */
int hyrax_mamba2_prefill_f32(const float *zxbcdt, int64_t tok_stride, const int64_t *starts, float *conv_pool,
                             int64_t conv_slots, const int64_t *conv_rows, const float *taps, const float *conv_bias,
                             int64_t K, float *ssm_pool, int64_t ssm_slots, const int64_t *ssm_rows,
                             const float *dt_bias, const float *A_log, const float *D, float dt_lo, float dt_hi,
                             const float *norm_w, float eps, int64_t group, int64_t mode, const int64_t *q_lens,
                             float *out, int64_t n_rows, int64_t B, int64_t H, int64_t G, int64_t P, int64_t N) {
    const int64_t inner = H * P, C = inner + 2 * G * N, keep = K - 1, R = H / G;
    const int rc = check(conv_slots, conv_rows, ssm_slots, ssm_rows, starts, q_lens, n_rows, inner, group, mode, B);
    if (rc)
        return rc;
    int64_t T = 1; /* the longest sequence: the scratch's length */
    for (int64_t b = 0; b < B; b++)
        T = q_lens[b] > T ? q_lens[b] : T;
    /* scratch: the conv outputs (T, C), the step sizes (T, H), one head's state (N, P) and two
       P-vectors, the conv state transposed (K-1, C), a token's gate (inner) */
    const size_t floats = (size_t)(T * C + T * H + N * P + 2 * P + (keep > 0 ? keep : 1) * C + inner);
    float *u = malloc(sizeof(float) * floats);
    if (!u)
        return -3;
    float *dts = u + T * C, *st = dts + T * H, *uv = st + N * P, *acc = uv + P, *head = acc + P,
          *gate = head + (keep > 0 ? keep : 1) * C;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = q_lens[b];
        const float *zb = zxbcdt + starts[b] * tok_stride;
        float *W = conv_pool + conv_rows[b] * C * keep;
        conv_head(head, W, C, keep);
        conv_window(u, head, zb + inner, tok_stride, taps, conv_bias, L, C, K);
        conv_keep(W, head, zb + inner, tok_stride, L, C, keep);
        for (int64_t i = 0; i < L * C; i++)
            u[i] = silu(u[i]);
        for (int64_t t = 0; t < L; t++)
            for (int64_t h = 0; h < H; h++)
                dts[t * H + h] = step_size(zb[t * tok_stride + inner + C + h], dt_bias[h], dt_lo, dt_hi);
        float *ob = out + starts[b] * inner;
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / R;
            float *S = ssm_pool + (ssm_rows[b] * H + h) * P * N;
            const float a = -expf(A_log[h]);
            to_np(st, S, P, N);
            for (int64_t t = 0; t < L; t++) {
                const float *ut = u + t * C, step = dts[t * H + h];
                advance_any(st, uv, acc, ut + h * P, ut + inner + g * N, ut + inner + G * N + g * N,
                            ob + t * inner + h * P, step, expf(step * a), D[h], P, N);
            }
            to_pn(S, st, P, N);
        }
        for (int64_t t = 0; t < L; t++)
            gated_norm(ob + t * inner, zb + t * tok_stride, gate, norm_w, eps, inner, group, mode);
    }
    free(u);
    return 0;
}
