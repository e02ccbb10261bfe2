/* Decode attention over the paged K/V pool, read where it lies (float32, CPU).

   One query token per sequence. Sequence b attends to the keys at positions lo..hi, where
   lo = max(first[b], qpos[b] - window + 1) (window 0: no window) and hi = min(first[b] +
   n_keys[b] - 1, qpos[b]); a key's pool row is table[b][p / page_size] * page_size +
   p % page_size. Pool rows are (2, G, D): K then V of G K/V heads; query head h reads K/V
   head h / (H / G). Each sequence is computed on its own, in the same order whatever else
   shares the step: two passes over its keys (scores and their maximum, then the softmax
   weights applied to V), each K and V row read once for all the query heads sharing it.

   Returns 0, or a negative code without having read outside the pool: -1 a key's page is
   not held (-1 in the table), -2 a row past the pool, -3 no memory for the scratch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* a . b, in LANES partial sums added pairwise: a fixed order the compiler can vectorise
   without reassociating anything */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int j = 0; j < LANES; j++)
            acc[j] += a[d + j] * b[d + j];
    float tail = 0.0f;
    for (; d < n; d++)
        tail += a[d] * b[d];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++)
            acc[j] += acc[j + w];
    return acc[0] + tail;
}

int hyrax_paged_decode_f32(const float *q, const float *pool, int64_t pool_rows, const int64_t *table,
                           int64_t table_cols, const int64_t *first, const int64_t *n_keys, const int64_t *qpos,
                           float *out, int64_t B, int64_t H, int64_t G, int64_t D, int64_t page_size,
                           int64_t window, float scale) {
    const int64_t R = H / G;
    int64_t most = 1;
    for (int64_t b = 0; b < B; b++)
        if (n_keys[b] > most)
            most = n_keys[b];
    /* scores of query head h over the sequence's keys: scores[h * most + i] */
    float *scores = malloc(sizeof(float) * (size_t)most * (size_t)H);
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)most);
    float *top = malloc(sizeof(float) * (size_t)H * 2);
    if (!scores || !rows || !top) {
        free(scores), free(rows), free(top);
        return -3;
    }
    float *total = top + H;
    const int64_t row_floats = 2 * G * D;
    int rc = 0;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        int64_t lo = first[b], hi = first[b] + n_keys[b] - 1;
        if (hi > qpos[b])
            hi = qpos[b];
        if (window > 0 && lo < qpos[b] - window + 1)
            lo = qpos[b] - window + 1;
        const int64_t n = hi - lo + 1;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        if (n <= 0) {
            memset(ob, 0, sizeof(float) * (size_t)(H * D));
            continue;
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = lo + i;
            const int64_t page = table[b * table_cols + p / page_size];
            if (page < 0) {
                rc = -1;
                break;
            }
            rows[i] = page * page_size + p % page_size;
            if (rows[i] >= pool_rows) {
                rc = -2;
                break;
            }
        }
        if (rc != 0)
            break;
        /* pass 1: every score, each key row read once for every head */
        for (int64_t h = 0; h < H; h++)
            top[h] = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const float *k = pool + rows[i] * row_floats;
            for (int64_t h = 0; h < H; h++) {
                const float s = dot(qb + h * D, k + (h / R) * D, D) * scale;
                scores[h * most + i] = s;
                if (s > top[h])
                    top[h] = s;
            }
        }
        /* pass 2: softmax weights, unnormalised */
        for (int64_t h = 0; h < H; h++) {
            float *sh = scores + h * most, sum = 0.0f;
            for (int64_t i = 0; i < n; i++) {
                sh[i] = expf(sh[i] - top[h]);
                sum += sh[i];
            }
            total[h] = sum;
        }
        /* pass 3: weighted values, each value row read once for every head */
        memset(ob, 0, sizeof(float) * (size_t)(H * D));
        for (int64_t i = 0; i < n; i++) {
            const float *v = pool + rows[i] * row_floats + G * D;
            for (int64_t h = 0; h < H; h++) {
                const float w = scores[h * most + i];
                const float *vh = v + (h / R) * D;
                float *oh = ob + h * D;
                for (int64_t d = 0; d < D; d++)
                    oh[d] += w * vh[d];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            const float inv = 1.0f / total[h];
            for (int64_t d = 0; d < D; d++)
                ob[h * D + d] *= inv;
        }
    }
    free(scores), free(rows), free(top);
    return rc;
}
