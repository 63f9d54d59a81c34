/* Least recently used: one list, oldest first. */
#include "ix.h"

void ix_lru_insert(ix_policy *pol, uint32_t slot) { ix_list_push(&pol->t1, pol->links, slot); }

void ix_lru_touch(ix_policy *pol, uint32_t slot) {
    ix_list_unlink(&pol->t1, pol->links, slot);
    ix_list_push(&pol->t1, pol->links, slot);
}

void ix_lru_remove(ix_policy *pol, uint32_t slot) { ix_list_unlink(&pol->t1, pol->links, slot); }
