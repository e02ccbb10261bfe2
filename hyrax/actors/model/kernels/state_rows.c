/* A request's rows of one state pool moved and hashed in one pass over them (state_rows.py).

The hash is state_hash.py's: the moved bytes in order as little-endian 64-bit words x[i],
zero-padded to whole hash rows of 256 words, h = sum_j v[j] * (sum_k w[k] * x[256 j + k])
mod 2^64 (the length term is added by the caller). w and v are the caller's weights.

gather: rows idx[0 .. n-1] of every layer of a pool (layers, pool_rows, row_bytes) into `out`,
layer after layer, and the hash of what was written there, computed while the bytes are still
in the cache. Nothing past layers * n * row_bytes bytes of `out` is written.

scatter: the same layout the other way: `src` into rows idx of every layer, then the hash of
what those rows hold once written, read back from the rows, as a gather of the written rows
would hash them: a row given twice shows in the hash. Rows that are all distinct are read back
right after each is written, while in the cache (no other write of the call touches them
after that); where some row is given twice, each layer's rows are read back after all of the
layer's writes.

Both check every row against the pool before touching anything (-1). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

#define ROW_WORDS 256
#define HASH_ROW_BYTES (ROW_WORDS * 8)

typedef uint64_t u64x8 __attribute__((vector_size(64)));

/* the products w[k] * x[k] of n words (x need not be aligned) added up: those of whole groups of
   16 words into the vector sums a0, a1, the rest returned (wrapping) */
static inline uint64_t add_words(u64x8 *a0, u64x8 *a1, const uint8_t *x, const uint64_t *w, int64_t n) {
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        u64x8 x0, x1, w0, w1;
        memcpy(&x0, x + 8 * k, 64);
        memcpy(&x1, x + 8 * (k + 8), 64);
        memcpy(&w0, w + k, 64);
        memcpy(&w1, w + k + 8, 64);
        *a0 += x0 * w0;
        *a1 += x1 * w1;
    }
    uint64_t s = 0;
    for (; k < n; k++) {
        uint64_t xk;
        memcpy(&xk, x + 8 * k, 8);
        s += xk * w[k];
    }
    return s;
}

static inline uint64_t lanes(u64x8 a) {
    uint64_t s = 0;
    for (int i = 0; i < 8; i++)
        s += a[i];
    return s;
}

/* sum_k w[k] * x[k] over n words (wrapping) */
static inline uint64_t dot_words(const uint8_t *x, const uint64_t *w, int64_t n) {
    u64x8 a0 = {0}, a1 = {0};
    uint64_t rest = add_words(&a0, &a1, x, w, n);
    return lanes(a0 + a1) + rest;
}

/* one whole hash row */
static inline uint64_t row_sum(const uint8_t *x, const uint64_t *w) {
    return dot_words(x, w, ROW_WORDS);
}

/* The hash terms of whole words read where they lie (a scatter's written rows of at least 128
   bytes, a multiple of 8: no staging copy), words at hash position `at` on: each hash row's
   products summed in vectors and reduced (and weighted by its row weight) once, when the words
   move past that row - not once per pool row (a 512-byte row is a quarter of a hash row). */
typedef struct {
    u64x8 a0, a1;   /* the current hash row's products so far */
    uint64_t tail;  /* and those of words past the last whole 16 of a span */
    int64_t row;    /* the current hash row (-1: none yet) */
    uint64_t h;
    const uint64_t *w, *v;
} spans;

static inline void spans_close(spans *s) {
    if (s->row < 0)
        return;
    s->h += s->v[s->row] * (lanes(s->a0 + s->a1) + s->tail);
    s->a0 = s->a1 = (u64x8){0};
    s->tail = 0;
}

static inline void spans_add(spans *s, const uint8_t *x, int64_t at, int64_t n) {
    while (n > 0) {
        int64_t j = at / ROW_WORDS, k = at % ROW_WORDS, m = ROW_WORDS - k < n ? ROW_WORDS - k : n;
        if (j != s->row) {
            spans_close(s);
            s->row = j;
        }
        s->tail += add_words(&s->a0, &s->a1, x, s->w + k, m);
        x += 8 * m, at += m, n -= m;
    }
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

/* Whether rows[0 .. n-1] are distinct, by a bitmap of the pool's rows kept per thread (every
   bit it sets is cleared before it returns); -1 where the bitmap cannot be had. */
static int distinct_in_pool(const int64_t *rows, int64_t n, int64_t pool_rows) {
    static __thread uint64_t *bits = NULL;
    static __thread int64_t words = 0;
    if (n < 2)
        return 1;
    int64_t need = (pool_rows + 63) / 64;
    if (need > words) {
        uint64_t *more = calloc(need, sizeof *more);
        if (more == NULL)
            return -1;
        free(bits);
        bits = more, words = need;
    }
    int64_t i = 0;
    int ok = 1;
    for (; i < n; i++) {
        uint64_t bit = 1ull << (rows[i] & 63), *word = bits + (rows[i] >> 6);
        if (*word & bit) {
            ok = 0;
            break;
        }
        *word |= bit;
    }
    for (int64_t j = 0; j < i; j++)
        bits[rows[j] >> 6] = 0;
    return ok;
}

int hyrax_scatter_hash(uint8_t *pool, int64_t layers, int64_t pool_rows, int64_t row_bytes,
                       const int64_t *idx, int64_t n, const uint8_t *src, const uint64_t *w, const uint64_t *v,
                       uint64_t *hash) {
    if (!in_pool(idx, n, pool_rows))
        return -1;
    stream s = {.fill = 0, .next = 0, .h = 0, .w = w, .v = v};
    spans sp = {.a0 = {0}, .a1 = {0}, .tail = 0, .row = -1, .h = 0, .w = w, .v = v};
    int in_place = row_bytes % 8 == 0 && row_bytes >= 128;  /* else rows are staged through `s` */
    int at_once = distinct_in_pool(idx, n, pool_rows) == 1;  /* read back right after each write */
    int64_t words = row_bytes / 8, at = 0;
    for (int64_t l = 0; l < layers; l++) {
        uint8_t *layer = pool + l * pool_rows * row_bytes;
        const uint8_t *from = src + l * n * row_bytes;
        for (int64_t r = 0; r < n; r++) {
            copy_row(layer + idx[r] * row_bytes, from + r * row_bytes, row_bytes);
            if (!at_once)
                continue;
            if (in_place)
                spans_add(&sp, layer + idx[r] * row_bytes, at, words);
            else
                feed(&s, layer + idx[r] * row_bytes, row_bytes);
            at += words;
        }
        for (int64_t r = 0; r < n && !at_once; r++, at += words) {
            if (in_place)
                spans_add(&sp, layer + idx[r] * row_bytes, at, words);
            else
                feed(&s, layer + idx[r] * row_bytes, row_bytes);
        }
    }
    spans_close(&sp);
    *hash = sp.h + finish(&s);
    return 0;
}

/* Several moves in one call (a request's components: one call per save or load instead of one
   per component; a call from Python costs microseconds each, more than a small component's
   copy). `moves`: count rows of MOVE_FIELDS int64s - pool, layers, pool_rows, row_bytes, idx,
   n, data (the addresses as integers) - each done as the single call would with the shared
   weights w and v; its hash (before the length term) to hashes[i]. Every move's rows are
   checked against its pool before anything is touched (-1). */
#define MOVE_FIELDS 7

static int moves_in_pools(const int64_t *moves, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t *m = moves + i * MOVE_FIELDS;
        if (!in_pool((const int64_t *)(intptr_t)m[4], m[5], m[2]))
            return 0;
    }
    return 1;
}

/* every move of the table, gathers or scatters */
static int run_moves(const int64_t *moves, int64_t count, const uint64_t *w, const uint64_t *v, uint64_t *hashes,
                     int scatter) {
    if (!moves_in_pools(moves, count))
        return -1;
    for (int64_t i = 0; i < count; i++) {
        const int64_t *m = moves + i * MOVE_FIELDS;
        uint8_t *pool = (uint8_t *)(intptr_t)m[0], *data = (uint8_t *)(intptr_t)m[6];
        const int64_t *idx = (const int64_t *)(intptr_t)m[4];
        if (scatter)
            hyrax_scatter_hash(pool, m[1], m[2], m[3], idx, m[5], data, w, v, hashes + i);
        else
            hyrax_gather_hash(pool, m[1], m[2], m[3], idx, m[5], data, w, v, hashes + i);
    }
    return 0;
}

int hyrax_gather_hash_many(const int64_t *moves, int64_t count, const uint64_t *w, const uint64_t *v,
                           uint64_t *hashes) {
    return run_moves(moves, count, w, v, hashes, 0);
}

int hyrax_scatter_hash_many(const int64_t *moves, int64_t count, const uint64_t *w, const uint64_t *v,
                            uint64_t *hashes) {
    return run_moves(moves, count, w, v, hashes, 1);
}
