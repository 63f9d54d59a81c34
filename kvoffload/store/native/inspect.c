/* The index read out for the binding, which never reads the index's fields itself: one key's
 * state, the counts, and the policy's lists copied out (for tests and tools, O(n)). */
#include <stdlib.h>
#include <string.h>

#include "ix.h"

ix_status_of ix_state_of(const ix_index *ix, const ix_key *k) {
    uint32_t s = ix_find(ix, k);
    ix_status_of out = {IX_FREE, -1, 0};
    if (s != IX_NIL) {
        out.state = ix->e[s].state;
        out.slot = s;
        out.readers = ix->e[s].readers;
    }
    return out;
}

void ix_counts(const ix_index *ix, uint32_t out[4]) {
    out[0] = ix->num_free;
    out[1] = ix->num_writing;
    out[2] = ix->num_readable;
    out[3] = ix->num_pinned;
}

void ix_keylist_free(ix_keylist *l) {
    for (int64_t i = 0; l->full != NULL && i < l->n; i++) free(l->full[i]);
    free(l->full);
    free(l->keys);
    memset(l, 0, sizeof *l);
}

static ix_status copy_list(const ix_index *ix, const ix_list *l, int ghosts, ix_keylist *out) {
    const ix_policy *pol = &ix->pol;
    int64_t cap = l ? (int64_t)l->len : 0;
    out->n = 0;
    out->keys = malloc((size_t)(cap ? cap : 1) * sizeof *out->keys);
    out->full = calloc((size_t)(cap ? cap : 1), sizeof *out->full);
    if (out->keys == NULL || out->full == NULL) return IX_NOMEM;
    const ix_link *links = ghosts ? pol->glinks : pol->links;
    for (uint32_t id = l ? l->head : IX_NIL; id != IX_NIL && out->n < cap; id = links[id].next) {
        ix_key *k = &out->keys[out->n];
        memcpy(k->b, ghosts ? pol->ghosts[id].b : ix->e[id].b, IX_KEY_BYTES);
        k->tag = ghosts ? pol->ghosts[id].tag : ix->e[id].tag;
        const uint8_t *full = !ghosts && ix->full ? ix->full[id] : NULL;
        if (full != NULL) {
            uint64_t len;
            memcpy(&len, full, 8);
            if ((out->full[out->n] = malloc(8 + len)) == NULL) return IX_NOMEM;
            memcpy(out->full[out->n], full, 8 + len);
        }
        out->n++;
    }
    return IX_OK;
}

ix_status ix_policy_lists(const ix_index *ix, ix_keylist out[IX_POLICY_LISTS], uint64_t *p) {
    const ix_list *lists[IX_POLICY_LISTS];
    ix_policy_order(&ix->pol, &lists[0], &lists[1]);
    lists[2] = &ix->pol.t1;
    lists[3] = &ix->pol.t2;
    lists[4] = &ix->pol.b1;
    lists[5] = &ix->pol.b2;
    memset(out, 0, IX_POLICY_LISTS * sizeof *out);
    ix_status st = IX_OK;
    for (int i = 0; i < IX_POLICY_LISTS && st == IX_OK; i++)
        st = copy_list(ix, lists[i], i >= 4, &out[i]);
    if (st != IX_OK)
        for (int i = 0; i < IX_POLICY_LISTS; i++) ix_keylist_free(&out[i]);
    *p = ix->pol.p;
    return st;
}
