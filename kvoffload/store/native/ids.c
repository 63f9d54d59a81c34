/* Engine block ids as the scheduler hands them to a transfer: copied into int64s and checked in
 * one pass, so that a call does no Python per id (kvoffload/offload/offloader.py, the fast path
 * of its block ids; anything this does not accept goes the checked Python way, which words the
 * refusal). */
#include <stdlib.h>
#include <string.h>

#include "ix.h"

/* Above this many possible ids a repeat is found by sorting a copy, not with a bitmap. */
#define IX_BITMAP_MAX_IDS (1LL << 24)

static int cmp_id(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int distinct(const int64_t *v, int64_t n, int64_t upper) {
    int64_t i = 1;
    while (i < n && v[i] > v[i - 1]) i++;
    if (i >= n) return 1; /* ascending: distinct */
    if (upper > 0 && upper <= IX_BITMAP_MAX_IDS) {
        uint8_t *seen = calloc((size_t)(upper / 8 + 1), 1);
        if (seen == NULL) return -1;
        int ok = 1;
        for (int64_t j = 0; j < n && ok; j++) {
            uint8_t bit = (uint8_t)(1u << (v[j] & 7));
            ok = !(seen[v[j] >> 3] & bit);
            seen[v[j] >> 3] |= bit;
        }
        free(seen);
        return ok;
    }
    int64_t *t = malloc((size_t)n * sizeof *t);
    if (t == NULL) return -1;
    memcpy(t, v, (size_t)n * sizeof *t);
    qsort(t, (size_t)n, sizeof *t, cmp_id);
    int ok = 1;
    for (int64_t j = 1; j < n && ok; j++) ok = t[j] != t[j - 1];
    free(t);
    return ok;
}

int ix_ids_fit(const int64_t *v, int64_t n, int64_t upper, int want_distinct) {
    for (int64_t i = 0; i < n; i++)
        if (v[i] < 0 || (upper >= 0 && v[i] >= upper)) return 0;
    return want_distinct && n > 1 ? distinct(v, n, upper) : 1;
}
