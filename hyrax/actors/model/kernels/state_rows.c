/* A request's rows of one state pool moved and hashed in one pass over them (state_rows.py).

The hash is state_hash.py's: the moved bytes in order as little-endian 64-bit words x[i],
zero-padded to whole hash rows of 256 words, h = sum_j v[j] * (sum_k w[k] * x[256 j + k])
mod 2^64 (the length term is added by the caller). w and v are the caller's weights.

gather: rows idx[0 .. n-1] of every layer of a pool (layers, pool_rows, row_bytes) into `out`,
layer after layer, and the hash of what was written there, computed while the bytes are still
in the cache. Nothing past layers * n * row_bytes bytes of `out` is written.

scatter: the same layout the other way: `src` into rows idx of every layer, then the hash of
what those rows hold once written (each layer's rows read back after all of the layer's rows
are written, as a gather of the written rows would: a row given twice shows in the hash).

Both check every row against the pool before touching anything (-1). */
#include <stdint.h>
#include <string.h>

#include "rows.h"

#define ROW_WORDS 256
#define HASH_ROW_BYTES (ROW_WORDS * 8)

typedef uint64_t u64x8 __attribute__((vector_size(64)));

/* sum_k w[k] * x[k] over n words (wrapping); x need not be aligned */
static inline uint64_t dot_words(const uint8_t *x, const uint64_t *w, int64_t n) {
    u64x8 a0 = {0}, a1 = {0};
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        u64x8 x0, x1, w0, w1;
        memcpy(&x0, x + 8 * k, 64);
        memcpy(&x1, x + 8 * (k + 8), 64);
        memcpy(&w0, w + k, 64);
        memcpy(&w1, w + k + 8, 64);
        a0 += x0 * w0;
        a1 += x1 * w1;
    }
    a0 += a1;
    uint64_t s = 0;
    for (int i = 0; i < 8; i++)
        s += a0[i];
    for (; k < n; k++) {
        uint64_t xk;
        memcpy(&xk, x + 8 * k, 8);
        s += xk * w[k];
    }
    return s;
}

/* one whole hash row */
static inline uint64_t row_sum(const uint8_t *x, const uint64_t *w) {
    return dot_words(x, w, ROW_WORDS);
}

/* The hash terms of n whole words that sit at word `at` of the hashed bytes, read where they
   lie (a scatter's written rows of at least 128 bytes, a multiple of 8: no staging copy). */
static inline uint64_t span(const uint8_t *x, int64_t at, int64_t n, const uint64_t *w, const uint64_t *v) {
    uint64_t h = 0;
    while (n > 0) {
        int64_t j = at / ROW_WORDS, k = at % ROW_WORDS, m = ROW_WORDS - k < n ? ROW_WORDS - k : n;
        h += v[j] * dot_words(x, w + k, m);
        x += 8 * m, at += m, n -= m;
    }
    return h;
}

/* Bytes fed in order; whole hash rows hashed as they complete (a gather hashes its output in
   place as whole rows complete; a scatter stages rows too small or odd-sized for `span`). */
typedef struct {
    uint8_t row[HASH_ROW_BYTES];
    int64_t fill;  /* bytes in `row` */
    int64_t next;  /* index of the hash row `row` will be */
    uint64_t h;
    const uint64_t *w, *v;
} stream;

static void feed(stream *s, const uint8_t *p, int64_t n) {
    if (s->fill) {  /* complete the pending row first */
        int64_t take = HASH_ROW_BYTES - s->fill < n ? HASH_ROW_BYTES - s->fill : n;
        memcpy(s->row + s->fill, p, take);
        s->fill += take, p += take, n -= take;
        if (s->fill < HASH_ROW_BYTES)
            return;
        s->h += s->v[s->next++] * row_sum(s->row, s->w);
        s->fill = 0;
    }
    for (; n >= HASH_ROW_BYTES; n -= HASH_ROW_BYTES, p += HASH_ROW_BYTES)
        s->h += s->v[s->next++] * row_sum(p, s->w);
    memcpy(s->row, p, n);
    s->fill = n;
}

static uint64_t finish(stream *s) {
    if (s->fill) {
        memset(s->row + s->fill, 0, HASH_ROW_BYTES - s->fill);
        s->h += s->v[s->next++] * row_sum(s->row, s->w);
        s->fill = 0;
    }
    return s->h;
}

/* memcpy of one row, inlined: state rows are tens to thousands of bytes, and a library call
   per 32-byte row cost more than the copy */
static inline void copy_row(uint8_t *d, const uint8_t *s, int64_t n) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        memcpy(d + i, s + i, 64);
    if (i + 32 <= n)
        memcpy(d + i, s + i, 32), i += 32;
    if (i + 16 <= n)
        memcpy(d + i, s + i, 16), i += 16;
    if (i + 8 <= n)
        memcpy(d + i, s + i, 8), i += 8;
    for (; i < n; i++)
        d[i] = s[i];
}

int hyrax_gather_hash(const uint8_t *pool, int64_t layers, int64_t pool_rows, int64_t row_bytes,
                      const int64_t *idx, int64_t n, uint8_t *out, const uint64_t *w, const uint64_t *v,
                      uint64_t *hash) {
    if (!in_pool(idx, n, pool_rows))
        return -1;
    stream s = {.fill = 0, .next = 0, .h = 0, .w = w, .v = v};
    int64_t hashed = 0, at = 0;  /* bytes of `out` hashed, written */
    for (int64_t l = 0; l < layers; l++) {
        const uint8_t *layer = pool + l * pool_rows * row_bytes;
        for (int64_t r = 0; r < n; r++) {
            copy_row(out + at, layer + idx[r] * row_bytes, row_bytes);
            at += row_bytes;
            int64_t whole = (at - hashed) / HASH_ROW_BYTES * HASH_ROW_BYTES;
            if (whole) {  /* hash the whole rows just written, in place */
                feed(&s, out + hashed, whole);
                hashed += whole;
            }
        }
    }
    feed(&s, out + hashed, at - hashed);
    *hash = finish(&s);
    return 0;
}

int hyrax_scatter_hash(uint8_t *pool, int64_t layers, int64_t pool_rows, int64_t row_bytes,
                       const int64_t *idx, int64_t n, const uint8_t *src, const uint64_t *w, const uint64_t *v,
                       uint64_t *hash) {
    if (!in_pool(idx, n, pool_rows))
        return -1;
    stream s = {.fill = 0, .next = 0, .h = 0, .w = w, .v = v};
    int64_t words = row_bytes / 8, at = 0;
    for (int64_t l = 0; l < layers; l++) {
        uint8_t *layer = pool + l * pool_rows * row_bytes;
        const uint8_t *from = src + l * n * row_bytes;
        for (int64_t r = 0; r < n; r++)
            copy_row(layer + idx[r] * row_bytes, from + r * row_bytes, row_bytes);
        for (int64_t r = 0; r < n; r++, at += words) {
            if (row_bytes % 8 == 0 && row_bytes >= 128)
                s.h += span(layer + idx[r] * row_bytes, at, words, w, v);
            else
                feed(&s, layer + idx[r] * row_bytes, row_bytes);
        }
    }
    *hash = finish(&s);
    return 0;
}
