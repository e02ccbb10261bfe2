/* What the kernels that update pool rows in place share. Included by their sources; the
   build's cache key covers every header in this directory (native.py). */
#ifndef HYRAX_ROWS_H
#define HYRAX_ROWS_H
#include <stdint.h>

/* whether rows[0 .. n-1] all lie in a pool of pool_rows rows */
static inline int in_pool(const int64_t *rows, int64_t n, int64_t pool_rows) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= pool_rows)
            return 0;
    return 1;
}

/* whether rows[0 .. n-1] are distinct (a step's sequences: tens, so pairwise) */
static inline int distinct(const int64_t *rows, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = 0; j < i; j++)
            if (rows[i] == rows[j])
                return 0;
    return 1;
}

#endif
