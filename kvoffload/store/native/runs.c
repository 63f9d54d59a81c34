/* Which blocks a store's eviction gives up (ix.h, ix_choose_runs). A store into a full arena
 * takes exactly its victims' slots, so victims taken in the policy's exact order hand each new
 * prefix the old prefixes' scatter: a load then moves one pitched copy per run of consecutive
 * slots and layer slice (kvoffload/transfer/cuda/native/copies.c). Among the window's candidates
 * (index.c, evict) the oldest not yet taken is taken with the rest of its run of consecutive
 * candidate slots, until enough are; of a run longer than what is still needed, the part around
 * that oldest (window_at). So the oldest candidate always goes, every run taken holds one of the
 * `want` the exact order would take, and the victims are never in more runs than those.
 * tests/index_model.py holds the same rule in Python. */
#include <stdlib.h>

#include "ix.h"

typedef struct {
    uint32_t slot, age; /* age: the candidate's position in the policy's order */
} cand;

static int by_slot(const void *a, const void *b) {
    uint32_t x = ((const cand *)a)->slot, y = ((const cand *)b)->slot;
    return (x > y) - (x < y);
}

static uint32_t youngest(const cand *c, int64_t from, int64_t count) {
    uint32_t age = 0;
    for (int64_t k = 0; k < count; k++)
        if (c[from + k].age > age) age = c[from + k].age;
    return age;
}

/* Where ``count`` of the run c[at..at+len) are taken from, always with the run's oldest candidate
 * (position ``oldest``): the ``count`` ending there, unless those starting there are older
 * (their youngest older). Recency runs last key first, so of a prefix stored in ascending slots
 * the tail is the oldest: the head taken instead would leave the tail behind, held and never hit
 * again (a lookup stops at the first miss). */
static int64_t window_at(const cand *c, int64_t at, int64_t len, int64_t oldest, int64_t count) {
    int64_t down = oldest - count + 1 > at ? oldest - count + 1 : at;
    int64_t up = oldest < at + len - count ? oldest : at + len - count;
    return youngest(c, up, count) < youngest(c, down, count) ? up : down;
}

ix_status ix_choose_runs(uint32_t *victims, int64_t n, int64_t want) {
    cand *c = malloc((size_t)n * sizeof *c);
    int64_t *start = malloc((size_t)n * sizeof *start); /* by age: its run's first position */
    int64_t *pos = malloc((size_t)n * sizeof *pos);     /* by age: its position by slot */
    int64_t *len = malloc((size_t)n * sizeof *len);     /* by position of a run's first */
    uint8_t *take = calloc((size_t)n, 1);               /* by age */
    if (c == NULL || start == NULL || pos == NULL || len == NULL || take == NULL) {
        free(c);
        free(start);
        free(pos);
        free(len);
        free(take);
        return IX_NOMEM;
    }
    for (int64_t i = 0; i < n; i++) c[i] = (cand){victims[i], (uint32_t)i};
    qsort(c, (size_t)n, sizeof *c, by_slot);
    int64_t first = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || c[i].slot != c[i - 1].slot + 1) {
            first = i;
            len[first] = 0;
        }
        len[first]++;
        start[c[i].age] = first;
        pos[c[i].age] = i;
    }
    int64_t need = want;
    for (int64_t age = 0; age < n && need > 0; age++) {
        if (take[age]) continue; /* runs are taken whole but for the last */
        int64_t at = start[age], count = len[at];
        if (count > need) {
            at = window_at(c, at, count, pos[age], need);
            count = need;
        }
        for (int64_t k = 0; k < count; k++) take[c[at + k].age] = 1;
        need -= count;
    }
    int64_t m = 0; /* the chosen, in the policy's order */
    for (int64_t i = 0; i < n; i++)
        if (take[i]) victims[m++] = victims[i];
    free(c);
    free(start);
    free(pos);
    free(len);
    free(take);
    return IX_OK;
}
