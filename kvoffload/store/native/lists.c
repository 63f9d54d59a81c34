/* Doubly linked lists of ids threaded through a links array: O(1) push, unlink and pop, 8 bytes
 * per member and no allocation. The head is the oldest member. */
#include "ix.h"

void ix_list_init(ix_list *l) {
    l->head = l->tail = IX_NIL;
    l->len = 0;
}

void ix_list_push(ix_list *l, ix_link *links, uint32_t id) {
    links[id].prev = l->tail;
    links[id].next = IX_NIL;
    if (l->tail == IX_NIL)
        l->head = id;
    else
        links[l->tail].next = id;
    l->tail = id;
    l->len++;
}

void ix_list_unlink(ix_list *l, ix_link *links, uint32_t id) {
    uint32_t p = links[id].prev, n = links[id].next;
    if (p == IX_NIL)
        l->head = n;
    else
        links[p].next = n;
    if (n == IX_NIL)
        l->tail = p;
    else
        links[n].prev = p;
    links[id].prev = links[id].next = IX_NIL;
    l->len--;
}

uint32_t ix_list_pop(ix_list *l, ix_link *links) {
    uint32_t id = l->head;
    if (id != IX_NIL) ix_list_unlink(l, links, id);
    return id;
}
