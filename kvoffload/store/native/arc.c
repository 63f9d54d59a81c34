/* Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), adapted to a store with pinned blocks
 * as the Python model in tests/index_model.py is: T1 holds blocks seen once, T2 blocks seen
 * again; B1 and B2 remember keys recently evicted from each (ghosts: a key only, 20 bytes, in a
 * pool grown on demand and a table of their own). A new block that is a B1 ghost grows the
 * target size p of T1, a B2 ghost shrinks it; victims come from T1 first while it is larger
 * than p. The store, not the policy, decides when to evict and skips pinned candidates, so
 * ix_policy_order gives both lists in preference order instead of one victim. */
#include <stdlib.h>
#include <string.h>

#include "ix.h"

#define GHOSTS_FIRST 1024 /* ghost pool's first size; it doubles when full */

typedef struct {
    const ix_ghost *g;
    const uint8_t *b;
    uint8_t tag;
} ghost_ctx;

static int ghost_match(const void *ctx, uint32_t id) {
    const ghost_ctx *c = ctx;
    return c->g[id].tag == c->tag && memcmp(c->g[id].b, c->b, IX_KEY_BYTES) == 0;
}

ix_status ix_arc_init(ix_policy *pol) {
    ix_list_init(&pol->b1);
    ix_list_init(&pol->b2);
    pol->ghosts = NULL;
    pol->glinks = NULL;
    pol->gcap = 0;
    pol->gfree = IX_NIL;
    pol->p = 0;
    return ix_table_init(&pol->gtable, GHOSTS_FIRST);
}

static ix_status grow_ghosts(ix_policy *pol) {
    uint32_t old = pol->gcap, cap = old ? old * 2 : GHOSTS_FIRST;
    ix_ghost *g = realloc(pol->ghosts, (size_t)cap * sizeof *g);
    if (g == NULL) return IX_NOMEM;
    pol->ghosts = g;
    ix_link *l = realloc(pol->glinks, (size_t)cap * sizeof *l);
    if (l == NULL) return IX_NOMEM;
    pol->glinks = l;
    for (uint32_t id = cap; id-- > old;) { /* free ids, lowest first */
        l[id].next = pol->gfree;
        pol->gfree = id;
    }
    pol->gcap = cap;
    return IX_OK;
}

static void drop_ghost(ix_policy *pol, ix_list *list, uint32_t id) {
    ix_ghost *g = &pol->ghosts[id];
    ix_list_unlink(list, pol->glinks, id);
    ix_table_del(&pol->gtable, ix_key_hash(g->b, g->tag), id);
    pol->glinks[id].next = pol->gfree;
    pol->gfree = id;
}

static ix_status add_ghost(ix_policy *pol, const ix_entry *e, uint8_t which) {
    if (pol->gfree == IX_NIL) {
        ix_status st = grow_ghosts(pol);
        if (st != IX_OK) return st;
    }
    uint32_t id = pol->gfree;
    ix_status st = ix_table_add(&pol->gtable, ix_key_hash(e->b, e->tag), id);
    if (st != IX_OK) return st;
    pol->gfree = pol->glinks[id].next;
    memcpy(pol->ghosts[id].b, e->b, IX_KEY_BYTES);
    pol->ghosts[id].tag = e->tag;
    pol->ghosts[id].list = which;
    ix_list_push(which == IX_B1 ? &pol->b1 : &pol->b2, pol->glinks, id);
    return IX_OK;
}

static uint64_t at_least_one(uint64_t x) { return x ? x : 1; }

ix_status ix_arc_insert(ix_index *ix, uint32_t slot) {
    ix_policy *pol = &ix->pol;
    ix_entry *e = &ix->e[slot];
    ghost_ctx ctx = {pol->ghosts, e->b, e->tag};
    uint32_t g = ix_table_find(&pol->gtable, ix_key_hash(e->b, e->tag), ghost_match, &ctx);
    uint64_t b1 = pol->b1.len, b2 = pol->b2.len;
    if (g != IX_NIL && pol->ghosts[g].list == IX_B1) {
        uint64_t p = pol->p + at_least_one(b2 / at_least_one(b1));
        pol->p = p < pol->capacity ? p : pol->capacity;
        drop_ghost(pol, &pol->b1, g);
    } else if (g != IX_NIL) {
        uint64_t d = at_least_one(b1 / at_least_one(b2));
        pol->p = pol->p > d ? pol->p - d : 0;
        drop_ghost(pol, &pol->b2, g);
    }
    e->list = g != IX_NIL ? IX_T2 : IX_T1;
    ix_list_push(g != IX_NIL ? &pol->t2 : &pol->t1, pol->links, slot);
    return IX_OK;
}

void ix_arc_touch(ix_index *ix, uint32_t slot) {
    ix_policy *pol = &ix->pol;
    ix_entry *e = &ix->e[slot];
    ix_list_unlink(e->list == IX_T1 ? &pol->t1 : &pol->t2, pol->links, slot);
    ix_list_push(&pol->t2, pol->links, slot);
    e->list = IX_T2;
}

ix_status ix_arc_remove(ix_index *ix, uint32_t slot, int evicted) {
    ix_policy *pol = &ix->pol;
    ix_entry *e = &ix->e[slot];
    int in_t1 = e->list == IX_T1;
    ix_list_unlink(in_t1 ? &pol->t1 : &pol->t2, pol->links, slot);
    e->list = 0;
    if (!evicted) return IX_OK;
    ix_status st = add_ghost(pol, e, in_t1 ? IX_B1 : IX_B2);
    if (st != IX_OK) return st;
    uint64_t c = pol->capacity;
    while (pol->b1.len && pol->t1.len + pol->b1.len > c) drop_ghost(pol, &pol->b1, pol->b1.head);
    while (pol->b2.len && pol->t1.len + pol->t2.len + pol->b1.len + pol->b2.len > 2 * c)
        drop_ghost(pol, &pol->b2, pol->b2.head);
    return IX_OK;
}
