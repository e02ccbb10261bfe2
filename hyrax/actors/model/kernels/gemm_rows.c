/* y = x @ w^T (+ b) for few rows of x (float32, CPU): the linear layers of a decode step.

   x is M x K, w is N x K (an nn.Linear weight as it lies), y is M x N, all row-major and
   contiguous; b (N) may be NULL. A BLAS runs a product of few rows by packing w into its own
   layout first, on every call: with 2-16 rows that copy costs about as much as the arithmetic
   (measured, one thread, a 3224 x 768 weight at 16 rows: 35-39 GFLOP/s through MKL). Here w is
   read once, where it lies: each output y[m][n] is the dot product of row m of x with row n
   of w, and a tile of MR rows of x by NR rows of w keeps its MR * NR dot products in vector
   registers over the whole of K, so each vector of w loaded serves MR rows of x.

   Every output is summed in the same order whatever M is and whichever tile computes it
   (8 lanes over K in steps of 8, the lanes added pairwise, then the K % 8 tail, then the
   bias), so a row's values do not depend on how many rows share the product.

   Returns 0. */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* the 8 lanes of v added pairwise (lane j + 4, then j + 2, then j + 1) */
static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[i][j] for i < MR, j < NR from rows x[i] and w[j]; `ahead`: the next tile's w rows, fetched
   into the cache while this one computes (NULL: none).
   KEEP: each vector of x and of w is loaded once and kept in a register for all the products
   that use it (the empty asm statements make the compiler materialise it): left alone, GCC
   folds the loads into the multiply-adds as memory operands, loading each vector once per
   product (15 loads for 12 products instead of 7), and the tile ran 10-20 % slower with its
   operands in the cache (2-core Zen 3, 16 rows). */
#define TILE(MR, NR)                                                                            \
    static void tile_##MR##_##NR(const float *x, const float *w, const float *b, float *y,     \
                                 int64_t N, int64_t K, const float *ahead) {                   \
        __m256 acc[MR][NR];                                                                     \
        for (int i = 0; i < MR; i++)                                                            \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                       \
        int64_t k = 0;                                                                          \
        for (; k + 8 <= K; k += 8) {                                                            \
            if (ahead)                                                                          \
                for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(ahead + j * K + k), _MM_HINT_T0); \
            __m256 xv[MR];                                                                      \
            for (int i = 0; i < MR; i++) {                                                      \
                xv[i] = _mm256_loadu_ps(x + i * K + k);                                         \
                __asm__("" : "+x"(xv[i])); /* in a register: see KEEP */                        \
            }                                                                                   \
            for (int j = 0; j < NR; j++) {                                                      \
                __m256 wv = _mm256_loadu_ps(w + j * K + k);                                     \
                __asm__("" : "+x"(wv));                                                         \
                for (int i = 0; i < MR; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]); \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < MR; i++)                                                            \
            for (int j = 0; j < NR; j++) {                                                      \
                float s = lanes_sum(acc[i][j]), tail = 0.0f;                                    \
                for (int64_t t = k; t < K; t++) tail += x[i * K + t] * w[j * K + t];            \
                y[i * N + j] = s + tail + (b ? b[j] : 0.0f);                                    \
            }                                                                                   \
    }

#else /* no AVX2 + FMA: the same order in plain C (the compiler vectorises what it can) */

#define TILE(MR, NR)                                                                            \
    static void tile_##MR##_##NR(const float *x, const float *w, const float *b, float *y,     \
                                 int64_t N, int64_t K, const float *ahead) {                   \
        (void)ahead;                                                                            \
        for (int i = 0; i < MR; i++)                                                            \
            for (int j = 0; j < NR; j++) {                                                      \
                float acc[8] = {0};                                                             \
                int64_t k = 0;                                                                  \
                for (; k + 8 <= K; k += 8)                                                      \
                    for (int l = 0; l < 8; l++) acc[l] += x[i * K + k + l] * w[j * K + k + l];  \
                for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];                               \
                for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];                               \
                float tail = 0.0f;                                                              \
                for (int64_t t = k; t < K; t++) tail += x[i * K + t] * w[j * K + t];            \
                y[i * N + j] = (acc[0] + acc[1]) + tail + (b ? b[j] : 0.0f);                    \
            }                                                                                   \
    }
#endif

/* 3 x 4: twelve accumulators, three rows of x and one vector of w in registers (sixteen) */
TILE(3, 4)
TILE(2, 4)
TILE(1, 4)
TILE(3, 1)
TILE(2, 1)
TILE(1, 1)

int hyrax_gemm_rows_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N,
                        int64_t K) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) {
        const float *wn = w + n * K, *bn = b ? b + n : 0;
        const float *ahead = n + 8 <= N ? wn + 4 * K : 0; /* fetched once, by the first tile */
        int64_t m = 0;
        /* threes, but the last four rows as two twos (a 1 x 4 tile loads five vectors per four products) */
        for (; m + 3 <= M && M - m != 4; m += 3)
            tile_3_4(x + m * K, wn, bn, y + m * N + n, N, K, m ? 0 : ahead);
        for (; m + 2 <= M; m += 2)
            tile_2_4(x + m * K, wn, bn, y + m * N + n, N, K, m ? 0 : ahead);
        if (m < M)
            tile_1_4(x + m * K, wn, bn, y + m * N + n, N, K, m ? 0 : ahead);
    }
    for (; n < N; n++) {
        const float *wn = w + n * K, *bn = b ? b + n : 0;
        int64_t m = 0;
        for (; m + 3 <= M; m += 3)
            tile_3_1(x + m * K, wn, bn, y + m * N + n, N, K, 0);
        for (; m + 2 <= M; m += 2)
            tile_2_1(x + m * K, wn, bn, y + m * N + n, N, K, 0);
        if (m < M)
            tile_1_1(x + m * K, wn, bn, y + m * N + n, N, K, 0);
    }
    return 0;
}
