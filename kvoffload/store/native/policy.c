/* The eviction policy of an index: the one place that knows there are two (LRU, ARC). */
#include <stdlib.h>

#include "ix.h"

ix_status ix_policy_init(ix_policy *pol, int kind, uint32_t capacity) {
    pol->kind = kind;
    pol->capacity = capacity;
    ix_list_init(&pol->t1);
    ix_list_init(&pol->t2);
    ix_list_init(&pol->b1);
    ix_list_init(&pol->b2);
    pol->gtable.b = NULL;
    pol->gtable.mask = 0;
    pol->ghosts = NULL;
    pol->glinks = NULL;
    pol->gcap = 0;
    pol->gfree = IX_NIL;
    pol->p = 0;
    pol->links = malloc((size_t)capacity * sizeof *pol->links);
    if (pol->links == NULL) return IX_NOMEM;
    return kind == IX_ARC ? ix_arc_init(pol) : IX_OK;
}

void ix_policy_free(ix_policy *pol) {
    free(pol->links);
    free(pol->ghosts);
    free(pol->glinks);
    ix_table_free(&pol->gtable);
    pol->links = NULL;
    pol->ghosts = NULL;
    pol->glinks = NULL;
}

size_t ix_policy_nbytes(const ix_policy *pol) {
    return (size_t)pol->capacity * sizeof *pol->links +
           (size_t)pol->gcap * (sizeof *pol->ghosts + sizeof *pol->glinks) +
           ix_table_nbytes(&pol->gtable);
}

ix_status ix_policy_insert(ix_index *ix, uint32_t slot) {
    if (ix->pol.kind == IX_ARC) return ix_arc_insert(ix, slot);
    ix->e[slot].list = IX_T1;
    ix_lru_insert(&ix->pol, slot);
    return IX_OK;
}

void ix_policy_touch(ix_index *ix, uint32_t slot) {
    if (ix->pol.kind == IX_ARC)
        ix_arc_touch(ix, slot);
    else
        ix_lru_touch(&ix->pol, slot);
}

ix_status ix_policy_remove(ix_index *ix, uint32_t slot, int evicted) {
    if (ix->pol.kind == IX_ARC) return ix_arc_remove(ix, slot, evicted);
    ix->e[slot].list = 0;
    ix_lru_remove(&ix->pol, slot);
    return IX_OK;
}

void ix_policy_order(const ix_policy *pol, const ix_list **first, const ix_list **second) {
    if (pol->kind != IX_ARC) {
        *first = &pol->t1;
        *second = NULL;
    } else if (pol->t1.len && pol->t1.len > pol->p) {
        *first = &pol->t1;
        *second = &pol->t2;
    } else {
        *first = &pol->t2;
        *second = &pol->t1;
    }
}
