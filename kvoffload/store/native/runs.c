/* Which blocks a store's eviction gives up (ix.h, ix_choose_runs). A store into a full arena
 * takes exactly its victims' slots, so victims taken in the policy's exact order hand each new
 * prefix the old prefixes' scatter: a load then moves one pitched copy per run of consecutive
 * slots and layer slice (kvoffload/transfer/cuda/native/copies.c). Chosen among the policy's
 * first `want x window` evictable blocks, the victims are the fewest runs of consecutive slots:
 * the shortest run that covers what is still needed (its lowest slots), else the longest run
 * whole, oldest first among equals. tests/index_model.py holds the same rule in Python. */
#include <stdlib.h>

#include "ix.h"

typedef struct {
    uint32_t slot, age; /* age: the candidate's position in the policy's order */
} cand;

typedef struct {
    int64_t at, len; /* the run's first candidate in slot order, its length */
    uint32_t age;    /* its oldest candidate's */
} run;

static int by_slot(const void *a, const void *b) {
    uint32_t x = ((const cand *)a)->slot, y = ((const cand *)b)->slot;
    return (x > y) - (x < y);
}

static int longest_oldest(const void *a, const void *b) {
    const run *x = a, *y = b;
    if (x->len != y->len) return x->len < y->len ? 1 : -1;
    return (x->age > y->age) - (x->age < y->age);
}

ix_status ix_choose_runs(uint32_t *victims, int64_t n, int64_t want) {
    cand *c = malloc((size_t)n * sizeof *c);
    run *r = malloc((size_t)n * sizeof *r);
    uint8_t *take = calloc((size_t)n, 1);
    if (c == NULL || r == NULL || take == NULL) {
        free(c);
        free(r);
        free(take);
        return IX_NOMEM;
    }
    for (int64_t i = 0; i < n; i++) c[i] = (cand){victims[i], (uint32_t)i};
    qsort(c, (size_t)n, sizeof *c, by_slot);
    int64_t runs = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i && c[i].slot == c[i - 1].slot + 1) {
            r[runs - 1].len++;
            if (c[i].age < r[runs - 1].age) r[runs - 1].age = c[i].age;
        } else {
            r[runs++] = (run){i, 1, c[i].age};
        }
    }
    qsort(r, (size_t)runs, sizeof *r, longest_oldest);
    int64_t need = want;
    for (int64_t i = 0; need > 0 && i < runs; i++) {
        int64_t pick = i, count = r[i].len;
        if (r[i].len >= need) { /* the shortest run that covers the rest, the oldest of those */
            while (pick + 1 < runs && r[pick + 1].len >= need) pick++;
            while (pick > i && r[pick - 1].len == r[pick].len) pick--;
            count = need;
        }
        for (int64_t k = 0; k < count; k++) take[c[r[pick].at + k].age] = 1;
        need -= count;
    }
    int64_t m = 0; /* the chosen, in the policy's order */
    for (int64_t i = 0; i < n; i++)
        if (take[i]) victims[m++] = victims[i];
    free(c);
    free(r);
    free(take);
    return IX_OK;
}
