/* Open addressing from a key's hash to an id: linear probing, deletion by backward shift (no
 * tombstones, so a long-lived table never degrades). A bucket is 8 bytes: the hash's low 32 bits
 * (home bucket and a filter before the owner compares keys) and the id + 1. */
#include <stdlib.h>

#include "ix.h"

#define MIN_BUCKETS 16

ix_status ix_table_init(ix_table *t, uint64_t capacity) {
    uint64_t n = MIN_BUCKETS;
    while (n * IX_LOAD_NUM < capacity * IX_LOAD_DEN) n <<= 1;
    t->b = calloc(n, sizeof *t->b);
    if (t->b == NULL) return IX_NOMEM;
    t->mask = n - 1;
    t->count = 0;
    return IX_OK;
}

void ix_table_free(ix_table *t) {
    free(t->b);
    t->b = NULL;
    t->count = 0;
}

size_t ix_table_nbytes(const ix_table *t) { return t->b ? (t->mask + 1) * sizeof *t->b : 0; }

uint32_t ix_table_find(const ix_table *t, uint64_t hash, ix_match match, const void *ctx) {
    uint32_t fp = (uint32_t)hash;
    for (uint64_t i = fp & t->mask;; i = (i + 1) & t->mask) {
        const ix_bucket *b = &t->b[i];
        if (b->id1 == 0) return IX_NIL;
        if (b->fp == fp && match(ctx, b->id1 - 1)) return b->id1 - 1;
    }
}

void ix_table_prefetch(const ix_table *t, uint64_t hash) {
    __builtin_prefetch(&t->b[(uint32_t)hash & t->mask]);
}

static void put(ix_bucket *b, uint64_t mask, uint32_t fp, uint32_t id1) {
    uint64_t i = fp & mask;
    while (b[i].id1 != 0) i = (i + 1) & mask;
    b[i].fp = fp;
    b[i].id1 = id1;
}

static ix_status grow(ix_table *t) {
    uint64_t n = (t->mask + 1) * 2;
    ix_bucket *b = calloc(n, sizeof *b);
    if (b == NULL) return IX_NOMEM;
    for (uint64_t i = 0; i <= t->mask; i++)
        if (t->b[i].id1) put(b, n - 1, t->b[i].fp, t->b[i].id1);
    free(t->b);
    t->b = b;
    t->mask = n - 1;
    return IX_OK;
}

ix_status ix_table_add(ix_table *t, uint64_t hash, uint32_t id) {
    if ((t->count + 1) * IX_LOAD_DEN > (t->mask + 1) * IX_LOAD_NUM) {
        ix_status st = grow(t);
        if (st != IX_OK) return st;
    }
    put(t->b, t->mask, (uint32_t)hash, id + 1);
    t->count++;
    return IX_OK;
}

void ix_table_del(ix_table *t, uint64_t hash, uint32_t id) {
    uint64_t mask = t->mask, i = (uint32_t)hash & mask;
    while (t->b[i].id1 != id + 1) {
        if (t->b[i].id1 == 0) return; /* not there */
        i = (i + 1) & mask;
    }
    /* shift later members of the run back over the hole when their home allows it */
    for (uint64_t j = (i + 1) & mask; t->b[j].id1 != 0; j = (j + 1) & mask) {
        uint64_t home = t->b[j].fp & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->b[i] = t->b[j];
            i = j;
        }
    }
    t->b[i].id1 = 0;
    t->b[i].fp = 0;
    t->count--;
}
