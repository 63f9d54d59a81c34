/* The index checked against itself, for tests: O(num_slots). Returns what contradicts, or NULL. */
#include <stdlib.h>

#include "ix.h"

static const char *lists(const ix_index *ix) {
    const ix_policy *pol = &ix->pol;
    const ix_list *own[2] = {&pol->t1, &pol->t2};
    uint64_t seen = 0;
    for (int l = 0; l < 2; l++) {
        uint64_t n = 0;
        for (uint32_t s = own[l]->head; s != IX_NIL; s = pol->links[s].next, n++) {
            if (ix->e[s].state != IX_READABLE || ix->e[s].list != (l ? IX_T2 : IX_T1))
                return "a policy list holds a block that is not READABLE in it";
            if (n > own[l]->len) return "a policy list is longer than its count";
        }
        if (n != own[l]->len) return "a policy list's count is wrong";
        seen += n;
    }
    if (seen != ix->num_readable) return "the policy does not track exactly the readable keys";
    if (pol->b1.len + pol->b2.len != (pol->gtable.b ? pol->gtable.count : 0))
        return "the ghost lists and the ghost table disagree";
    return NULL;
}

const char *ix_check(const ix_index *ix) {
    uint8_t *is_free = calloc(ix->num_slots ? ix->num_slots : 1, 1);
    if (is_free == NULL) return "no memory to check";
    const char *bad = NULL;
    for (uint32_t i = 0; i < ix->num_free && !bad; i++) {
        uint32_t s = ix->free[i];
        if (s >= ix->num_slots || is_free[s] || ix->e[s].state != IX_FREE)
            bad = "slots are not partitioned into free / writing / readable";
        else
            is_free[s] = 1;
    }
    uint64_t writing = 0, readable = 0, pinned = 0;
    for (uint32_t s = 0; s < ix->num_slots && !bad; s++) {
        const ix_entry *e = &ix->e[s];
        if (e->state == IX_FREE) {
            if (!is_free[s] || e->readers || e->tag != IX_TAG_NONE)
                bad = "slots are not partitioned into free / writing / readable";
            continue;
        }
        writing += e->state == IX_WRITING;
        readable += e->state == IX_READABLE;
        pinned += e->readers > 0;
        if (e->readers && e->state != IX_READABLE) bad = "a key being read is not readable";
        ix_key k = {0};
        for (int i = 0; i < IX_KEY_BYTES; i++) k.b[i] = e->b[i];
        k.tag = e->tag;
        k.hash = ix_key_hash(e->b, e->tag);
        if (e->tag == IX_TAG_LONG) {
            const uint8_t *full = ix->full ? ix->full[s] : NULL;
            if (full == NULL) {
                bad = "a long key lost its bytes";
                continue;
            }
            uint64_t len = 0;
            for (int i = 0; i < 8; i++) ((uint8_t *)&len)[i] = full[i];
            k.full = full + 8;
            k.len = len;
        }
        if (!bad && ix_find(ix, &k) != s) bad = "a block's key does not find its slot";
    }
    free(is_free);
    if (bad) return bad;
    if (writing != ix->num_writing || readable != ix->num_readable || pinned != ix->num_pinned)
        return "the counts of writing / readable / pinned blocks are wrong";
    if (ix->table.count != writing + readable) return "the table holds other keys than the slots";
    if (ix->num_free + writing + readable != ix->num_slots) return "a slot is lost";
    return lists(ix);
}
