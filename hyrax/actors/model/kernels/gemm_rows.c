/* y = x @ w^T (+ b) for few rows of x (float32, CPU): the linear layers of a decode step.

   x is M x K, w is N x K (an nn.Linear weight as it lies), y is M x N, all row-major and
   contiguous; b (N) may be NULL. A BLAS runs a product of few rows by packing w into its own
   layout first, on every call: with 2-16 rows that copy costs about as much as the arithmetic
   (measured, one thread, a 3224 x 768 weight at 16 rows: 35-39 GFLOP/s through MKL). Here w is
   read once, where it lies: each output y[m][n] is the dot product of row m of x with row n
   of w, and a tile of MR rows of x by four rows of w keeps its MR * 4 dot products in vector
   registers, so each vector of w loaded serves MR rows of x.

   The weight is read in groups of four rows; every tile of x's rows goes over a group before
   the next group starts, so a group is read from memory once and then from the L1 cache.
   Three things keep the arithmetic fed while w streams from memory (a model's weights do not
   fit in the cache; measured on the 2-core Zen 3 VM, one thread, 64+ MB of weights cycled, in
   interleaved medians, GFLOP/s before / after, a (3224, 768) weight: 4 rows 29 / 37, 8 rows
   45 / 66, 12 rows 55 / 78, 16 rows 58 / 82, and alike for the other K = 768 weights; (768,
   2048) 31 / 37, 46 / 56-62, 54 / 61, 56 / 66-70; one core's peak is ~100):
   - the next group is prefetched in the order its first tile will read it (along k, its four
     rows side by side), spread evenly over all the tiles of the current group: prefetching it
     all in the group's first tile, row after row, left the memory idle for the rest of the
     group and the next group's first rows arriving late;
   - a group is gone over in K blocks of at most K_BLOCK floats (12 KiB of w), so that it stays
     in the L1 cache for all of x's tiles where K is long (a (768, 2048) weight's group is 32
     KiB, the whole L1); each tile carries its sums from block to block;
   - where K takes blocks, x is copied to rows whose stride is an odd number of cache lines:
     rows 6 or 8 KiB apart fell into the same few L1 sets as w's, and the blocks gained little
     without the copy ((768, 2048) at 16 rows: 59 GFLOP/s blocked, 65 blocked and copied).

   Every output is summed in the same order whatever M is and whichever tile computes it
   (8 lanes over K in steps of 8, the lanes added pairwise, then the K % 8 tail, then the
   bias), so a row's values do not depend on how many rows share the product: blocks carry
   each lane's running sum unchanged, and the four sums of a row are reduced in one vector
   in the order a single one is.

   Returns 0. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK_ROWS 16 /* rows of x gone over at once (the sums of a chunk live on the stack) */
#define K_BLOCK 768   /* most floats of K a group is gone over in at once: 4 rows x 3 KiB of w */

/* the K % 8 tail of a dot product, in index order */
static inline float tail_dot(const float *x, const float *w, int64_t from, int64_t K) {
    float s = 0.0f;
    for (int64_t k = from; k < K; k++) s += x[k] * w[k];
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* the 8 lanes of v added pairwise (lane j + 4, then j + 2, then j + 1) */
static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lanes_sum of a, b, c and d, in that order, each added in lanes_sum's order */
static inline __m128 lanes_sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    /* halves: [a0+a4 .. a3+a7 | b0+b4 .. b3+b7], and the same of c, d */
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    /* quarters: [a h0+h2, a h1+h3, c h0+h2, c h1+h3 | the same of b, d] */
    __m256 q = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    /* q0 + q1 in lanes 0 and 2 of each half: [a . c . | b . d .] */
    __m256 s = _mm256_add_ps(q, _mm256_movehdup_ps(q));
    __m128 acbd = _mm_shuffle_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1), 0x88);
    return _mm_shuffle_ps(acbd, acbd, 0xD8);
}

/* The next group of w rows, fetched into the cache a line at a time while the tiles of this
   group compute: line q is line q / 4 of row q % 4 (the order the group's first tile reads
   them), `lines` of them spread evenly over the `steps` steps of 8 floats that this group's
   tiles take (`credit`: the count of lines owed, in 1 / steps). lines 0: none. */
typedef struct {
    const char *rows;
    int64_t row_bytes, next, lines, steps, credit;
} Ahead;

/* acc[i][j] += the products of x row i and w row j over k in [k0, k1) (k1 - k0 a multiple of
   8), for i < MR, j < NR; the sums come from and go back to sums[i * 4 + j] (zero where
   `first`). `ahead`: the next group's fetch, stepped once per 8 floats (NULL: none).
   The tile's scalars are few enough to stay in registers: a fetch state read through a
   pointer, or fetching several lines at once, cost up to 10 % at 16 rows.
   KEEP: each vector of x and of w is loaded once and kept in a register for all the products
   that use it (the empty asm statements make the compiler materialise it): left alone, GCC
   folds the loads into the multiply-adds as memory operands, loading each vector once per
   product (15 loads for 12 products instead of 7), and the tile ran 10-20 % slower with its
   operands in the cache (2-core Zen 3, 16 rows). */
#define TILE(MR, NR)                                                                            \
    static inline __attribute__((always_inline)) void tile_##MR##_##NR(                        \
        const float *x, int64_t ldx, const float *w, int64_t K, int64_t k0, int64_t k1,         \
        __m256 *sums, int first, Ahead *ahead) {                                                \
        __m256 acc[MR][NR];                                                                     \
        for (int i = 0; i < MR; i++)                                                            \
            for (int j = 0; j < NR; j++) acc[i][j] = first ? _mm256_setzero_ps() : sums[i * 4 + j]; \
        const char *rows = ahead ? ahead->rows : 0;                                             \
        int64_t row_bytes = ahead ? ahead->row_bytes : 0, q = ahead ? ahead->next : 0;          \
        int64_t lines = ahead ? ahead->lines : 0;                                               \
        int64_t steps = ahead ? ahead->steps : 1, credit = ahead ? ahead->credit : 0;           \
        for (int64_t k = k0; k < k1; k += 8) {                                                  \
            if ((credit += lines) >= steps) {                                                   \
                credit -= steps;                                                                \
                if (q < lines) {                                                                \
                    _mm_prefetch(rows + (q & 3) * row_bytes + (q >> 2) * 64, _MM_HINT_T0);      \
                    q++;                                                                        \
                }                                                                               \
            }                                                                                   \
            __m256 xv[MR];                                                                      \
            for (int i = 0; i < MR; i++) {                                                      \
                xv[i] = _mm256_loadu_ps(x + i * ldx + k);                                       \
                __asm__("" : "+x"(xv[i])); /* in a register: see KEEP */                        \
            }                                                                                   \
            for (int j = 0; j < NR; j++) {                                                      \
                __m256 wv = _mm256_loadu_ps(w + j * K + k);                                     \
                __asm__("" : "+x"(wv));                                                         \
                for (int i = 0; i < MR; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]); \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < MR; i++)                                                            \
            for (int j = 0; j < NR; j++) sums[i * 4 + j] = acc[i][j];                           \
        if (ahead)                                                                              \
            ahead->next = q, ahead->credit = credit;                                            \
    }

/* 3 x 4: twelve sums, three rows of x and one vector of w in registers (sixteen) */
TILE(3, 4)
TILE(2, 4)
TILE(1, 4)
TILE(3, 1)
TILE(2, 1)
TILE(1, 1)

/* rows [0, rows) of x (stride ldx) times w's rows n .. n + 3 into y's columns n .. n + 3 */
static inline __attribute__((always_inline)) void group_of_four(
    const float *x, int64_t ldx, int64_t rows, const float *w, const float *b, float *y, int64_t n, int64_t N,
    int64_t K, int64_t kblock, Ahead *ahead) {
    __m256 sums[CHUNK_ROWS * 4];
    const float *wn = w + n * K;
    int64_t K8 = K & ~(int64_t)7;
    for (int64_t k0 = 0; k0 < K8 || k0 == 0; k0 += kblock) {
        int64_t k1 = K8 - k0 < kblock ? K8 : k0 + kblock;
        int64_t m = 0;
        /* threes, but the last four rows as two twos (a 1 x 4 tile loads five vectors per four products) */
        for (; m + 3 <= rows && rows - m != 4; m += 3)
            tile_3_4(x + m * ldx, ldx, wn, K, k0, k1, sums + m * 4, k0 == 0, ahead);
        for (; m + 2 <= rows; m += 2)
            tile_2_4(x + m * ldx, ldx, wn, K, k0, k1, sums + m * 4, k0 == 0, ahead);
        if (m < rows)
            tile_1_4(x + m * ldx, ldx, wn, K, k0, k1, sums + m * 4, k0 == 0, ahead);
    }
    __m128 bias = b ? _mm_loadu_ps(b + n) : _mm_setzero_ps();
    for (int64_t m = 0; m < rows; m++) {
        const __m256 *s = sums + m * 4;
        const float *xm = x + m * ldx;
        __m128 tail = _mm_setzero_ps();
        if (K8 < K)
            tail = _mm_setr_ps(tail_dot(xm, wn, K8, K), tail_dot(xm, wn + K, K8, K), tail_dot(xm, wn + 2 * K, K8, K),
                               tail_dot(xm, wn + 3 * K, K8, K));
        _mm_storeu_ps(y + m * N + n, _mm_add_ps(_mm_add_ps(lanes_sum4(s[0], s[1], s[2], s[3]), tail), bias));
    }
}

/* rows [0, rows) of x (stride ldx) times w's row n alone into y's column n */
static void single_row(const float *x, int64_t ldx, int64_t rows, const float *w, const float *b, float *y,
                       int64_t n, int64_t N, int64_t K) {
    __m256 sums[CHUNK_ROWS * 4];
    const float *wn = w + n * K;
    int64_t K8 = K & ~(int64_t)7, m = 0;
    for (; m + 3 <= rows; m += 3)
        tile_3_1(x + m * ldx, ldx, wn, K, 0, K8, sums + m * 4, 1, 0);
    for (; m + 2 <= rows; m += 2)
        tile_2_1(x + m * ldx, ldx, wn, K, 0, K8, sums + m * 4, 1, 0);
    if (m < rows)
        tile_1_1(x + m * ldx, ldx, wn, K, 0, K8, sums + m * 4, 1, 0);
    for (m = 0; m < rows; m++)
        y[m * N + n] = lanes_sum(sums[m * 4]) + tail_dot(x + m * ldx, wn, K8, K) + (b ? b[n] : 0.0f);
}

int hyrax_gemm_rows_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N,
                        int64_t K) {
    int64_t K8 = K & ~(int64_t)7, blocks = K8 > K_BLOCK ? (K8 + K_BLOCK - 1) / K_BLOCK : 1;
    int64_t kblock = K8 > K_BLOCK ? ((K8 / blocks) + 7) & ~(int64_t)7 : (K8 ? K8 : 8);
    /* where K takes blocks, x's rows copied to a stride of an odd number of 64-byte lines (not
       where there is no memory for them) */
    int64_t ldx = (K + 15) & ~(int64_t)15;
    ldx += (ldx / 16) % 2 ? 0 : 16;
    void *copy = blocks > 1 ? malloc((size_t)(M < CHUNK_ROWS ? M : CHUNK_ROWS) * ldx * sizeof(float) + 64) : 0;
    float *xpad = copy ? (float *)(((uintptr_t)copy + 63) & ~(uintptr_t)63) : 0;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        int64_t rows = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
        const float *xc = x + m0 * K;
        int64_t ld = K;
        if (xpad) {
            for (int64_t i = 0; i < rows; i++) memcpy(xpad + i * ldx, xc + i * K, K * sizeof(float));
            xc = xpad, ld = ldx;
        }
        float *yc = y + m0 * N;
        /* steps of 8 floats the tiles of a group take: the next group's lines are spread over them */
        int64_t tiles = rows / 3 + (rows % 3 != 0); /* twos where a three would leave one */
        int64_t steps = tiles * (K8 / 8), lines = 4 * ((K * 4 + 63) / 64);
        int64_t n = 0;
        for (; n + 4 <= N; n += 4) {
            Ahead ahead = {(const char *)(w + (n + 4) * K), K * 4, 0, n + 8 <= N ? lines : 0, steps ? steps : 1, 0};
            group_of_four(xc, ld, rows, w, b, yc, n, N, K, kblock, &ahead);
        }
        for (; n < N; n++)
            single_row(xc, ld, rows, w, b, yc, n, N, K);
    }
    free(copy);
    return 0;
}

#else /* no AVX2 + FMA: each output in the same order in plain C (the compiler vectorises what it can) */

int hyrax_gemm_rows_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N,
                        int64_t K) {
    int64_t K8 = K & ~(int64_t)7;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            const float *xm = x + m * K, *wn = w + n * K;
            float acc[8] = {0};
            for (int64_t k = 0; k < K8; k += 8)
                for (int l = 0; l < 8; l++) acc[l] += xm[k + l] * wn[k + l];
            for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
            for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
            y[m * N + n] = (acc[0] + acc[1]) + tail_dot(xm, wn, K8, K) + (b ? b[n] : 0.0f);
        }
    return 0;
}
#endif
