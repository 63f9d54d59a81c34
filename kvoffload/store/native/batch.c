/* The distinct keys of one call (a repeated key in a store, the readers one release drops): a
 * throwaway table over the call's positions, so the cost is O(n) whatever the index holds. */
#include <stdlib.h>
#include <string.h>

#include "ix.h"

typedef struct {
    const ix_key *keys;
    const ix_key *probe;
} batch_ctx;

int ix_key_equal(const ix_key *a, const ix_key *b) {
    if (a->tag != b->tag || a->tag == IX_TAG_NONE) return 0;
    if (memcmp(a->b, b->b, IX_KEY_BYTES) != 0) return 0;
    return a->tag != IX_TAG_LONG || (a->len == b->len && memcmp(a->full, b->full, a->len) == 0);
}

static int batch_match(const void *ctx, uint32_t id) {
    const batch_ctx *c = ctx;
    return ix_key_equal(&c->keys[id], c->probe);
}

int64_t ix_batch_firsts(const ix_key *keys, int64_t n, int64_t *first) {
    if (n <= 1) {
        if (n == 1) first[0] = 0;
        return 0;
    }
    ix_table t;
    if (ix_table_init(&t, (uint64_t)n) != IX_OK) return -1;
    int64_t repeats = 0;
    for (int64_t i = 0; i < n; i++) {
        batch_ctx ctx = {keys, &keys[i]};
        uint32_t j = ix_table_find(&t, keys[i].hash, batch_match, &ctx);
        if (j != IX_NIL) {
            first[i] = j;
            repeats++;
        } else {
            first[i] = i;
            if (ix_table_add(&t, keys[i].hash, (uint32_t)i) != IX_OK) {
                ix_table_free(&t);
                return -1;
            }
        }
    }
    ix_table_free(&t);
    return repeats;
}
