/* The index: which key holds which host slot, in which state, with how many readers. The
 * two-phase protocol it keeps is written down once, in kvoffload/store/index.py. Every entry
 * point that refuses its input returns the refusal before it changes anything. */
#include <stdlib.h>
#include <string.h>

#include "ix.h"

typedef struct {
    const ix_index *ix;
    const ix_key *k;
} find_ctx;

static uint64_t full_len(const uint8_t *full) {
    uint64_t n;
    memcpy(&n, full, sizeof n);
    return n;
}

static int entry_match(const void *ctx, uint32_t slot) {
    const find_ctx *c = ctx;
    const ix_entry *e = &c->ix->e[slot];
    if (e->tag != c->k->tag || memcmp(e->b, c->k->b, IX_KEY_BYTES) != 0) return 0;
    if (e->tag != IX_TAG_LONG) return 1;
    const uint8_t *full = c->ix->full[slot];
    return full_len(full) == c->k->len && memcmp(full + 8, c->k->full, c->k->len) == 0;
}

uint32_t ix_find(const ix_index *ix, const ix_key *k) {
    if (k->tag == IX_TAG_NONE) return IX_NIL;
    find_ctx ctx = {ix, k};
    return ix_table_find(&ix->table, k->hash, entry_match, &ctx);
}

uint32_t ix_find_at(const ix_index *ix, const ix_key *keys, int64_t n, int64_t i) {
    if (i + IX_PREFETCH < n) ix_table_prefetch(&ix->table, keys[i + IX_PREFETCH].hash);
    return ix_find(ix, &keys[i]);
}

static int readable(const ix_index *ix, uint32_t slot) {
    return slot != IX_NIL && ix->e[slot].state == IX_READABLE;
}

ix_status ix_init(ix_index *ix, uint32_t num_slots, int policy) {
    memset(ix, 0, sizeof *ix);
    ix->num_slots = num_slots;
    ix->e = calloc(num_slots, sizeof *ix->e);
    ix->free = malloc((size_t)num_slots * sizeof *ix->free);
    if (ix->e == NULL || ix->free == NULL) return IX_NOMEM;
    for (uint32_t i = 0; i < num_slots; i++) ix->free[i] = num_slots - 1 - i; /* pops 0 first */
    ix->num_free = num_slots;
    ix->window = 1;
    ix_status st = ix_table_init(&ix->table, num_slots);
    if (st == IX_OK) st = ix_policy_init(&ix->pol, policy, num_slots);
    if (st != IX_OK) return st;
    /* Fault every page in now, not on the scheduler's first stores into it: measured on the
     * 2-core CI VM, prepare_store of 512 new keys into pages never touched took 136 us against
     * 49 us once they were (the memory is the index's size either way). */
    memset(ix->e, 0, (size_t)num_slots * sizeof *ix->e);
    memset(ix->table.b, 0, ix_table_nbytes(&ix->table));
    memset(ix->pol.links, 0, (size_t)num_slots * sizeof *ix->pol.links);
    return IX_OK;
}

void ix_free(ix_index *ix) {
    if (ix->full != NULL)
        for (uint32_t i = 0; i < ix->num_slots; i++) free(ix->full[i]);
    free(ix->full);
    free(ix->e);
    free(ix->free);
    ix_table_free(&ix->table);
    ix_policy_free(&ix->pol);
    memset(ix, 0, sizeof *ix);
}

size_t ix_nbytes(const ix_index *ix) {
    size_t n = (size_t)ix->num_slots * (sizeof *ix->e + sizeof *ix->free);
    if (ix->full != NULL) {
        n += (size_t)ix->num_slots * sizeof *ix->full;
        for (uint32_t i = 0; i < ix->num_slots; i++)
            if (ix->full[i]) n += 8 + full_len(ix->full[i]);
    }
    return n + ix_table_nbytes(&ix->table) + ix_policy_nbytes(&ix->pol);
}

int64_t ix_lookup(ix_index *ix, const ix_key *keys, int64_t n) {
    int64_t i = 0;
    while (i < n && readable(ix, ix_find_at(ix, keys, n, i))) i++;
    return i;
}

/* -- dropping a READABLE block ----------------------------------------------------------------- */

static ix_status drop(ix_index *ix, uint32_t slot, int evicted, ix_plan *out) {
    ix_entry *e = &ix->e[slot];
    ix_key *k = &out->ev_keys[out->n_evicted];
    memcpy(k->b, e->b, IX_KEY_BYTES);
    k->tag = e->tag;
    out->ev_full[out->n_evicted++] = ix->full ? ix->full[slot] : NULL;
    if (ix->full) ix->full[slot] = NULL;
    ix_status st = ix_policy_remove(ix, slot, evicted);
    ix_table_del(&ix->table, ix_key_hash(e->b, e->tag), slot);
    memset(e, 0, sizeof *e);
    ix->free[ix->num_free++] = slot;
    ix->num_readable--;
    return st;
}

/* Slots freed together leave the free stack in the order they were freed: the pushes since
 * ``from`` are reversed, so a run of consecutive slots comes back as an ascending run (a load
 * moves it as one 2D copy per layer slice: kvoffload/transfer/cuda/native/pipeline.c). */
static void freed_in_order(ix_index *ix, uint32_t from) {
    for (uint32_t a = from, b = ix->num_free; a + 1 < b; a++, b--) {
        uint32_t t = ix->free[a];
        ix->free[a] = ix->free[b - 1];
        ix->free[b - 1] = t;
    }
}

static ix_status out_alloc(ix_plan *out, int64_t n) {
    out->ev_keys = malloc((size_t)(n ? n : 1) * sizeof *out->ev_keys);
    out->ev_full = malloc((size_t)(n ? n : 1) * sizeof *out->ev_full);
    out->n_evicted = 0;
    return out->ev_keys && out->ev_full ? IX_OK : IX_NOMEM;
}

/* Up to ``want`` unpinned, unmarked READABLE slots dropped as evicted: the first in policy order,
 * or (window > 1) by runs of slots among the first want x window, at most ix.h's share more. */
static ix_status evict(ix_index *ix, int64_t want, int evicted, uint32_t window, ix_plan *out) {
    int64_t extra = want * (int64_t)(window - 1), most = ix->num_slots / IX_WINDOW_SHARE;
    int64_t room = want + (extra < most ? extra : most);
    if (room > ix->num_readable) room = ix->num_readable > want ? ix->num_readable : want;
    uint32_t *victims = malloc((size_t)(room ? room : 1) * sizeof *victims);
    if (victims == NULL) return IX_NOMEM;
    const ix_list *lists[2];
    ix_policy_order(&ix->pol, &lists[0], &lists[1]);
    int64_t n = 0;
    for (int l = 0; l < 2 && n < room; l++) {
        if (lists[l] == NULL) continue;
        for (uint32_t s = lists[l]->head; s != IX_NIL && n < room; s = ix->pol.links[s].next)
            if (ix->e[s].readers == 0 && !ix->e[s].mark) victims[n++] = s;
    }
    ix_status st = IX_OK;
    if (n > want) {
        st = ix_choose_runs(victims, n, want);
        n = want;
    }
    uint32_t from = ix->num_free;
    for (int64_t i = 0; i < n && st == IX_OK; i++) st = drop(ix, victims[i], evicted, out);
    freed_in_order(ix, from);
    free(victims);
    return st;
}

ix_status ix_evict(ix_index *ix, int64_t n, ix_plan *out) {
    memset(out, 0, sizeof *out);
    if (n > ix->num_readable) n = ix->num_readable;
    ix_status st = out_alloc(out, n);
    return st != IX_OK ? st : evict(ix, n, 1, 1, out);
}

ix_status ix_remove(ix_index *ix, const ix_key *keys, int64_t n, int all, ix_plan *out) {
    memset(out, 0, sizeof *out);
    ix_status st = out_alloc(out, all ? ix->num_readable : n);
    if (st != IX_OK || all) return st != IX_OK ? st : evict(ix, ix->num_readable, 0, 1, out);
    uint32_t from = ix->num_free;
    for (int64_t i = 0; i < n && st == IX_OK; i++) {
        uint32_t s = ix_find(ix, &keys[i]);
        if (readable(ix, s) && ix->e[s].readers == 0) st = drop(ix, s, 0, out);
    }
    freed_in_order(ix, from);
    return st;
}

void ix_plan_free(ix_plan *plan) {
    if (plan->ev_full != NULL)
        for (int64_t i = 0; i < plan->n_evicted; i++) free(plan->ev_full[i]);
    free(plan->pos);
    free(plan->slots);
    free(plan->ev_keys);
    free(plan->ev_full);
    memset(plan, 0, sizeof *plan);
}

/* -- stores ------------------------------------------------------------------------------------ */

static ix_status check_keys(const ix_key *keys, int64_t n, ix_refusal *why) {
    for (int64_t i = 0; i < n; i++)
        if (keys[i].tag == IX_TAG_NONE) {
            why->count = 1;
            why->first = i;
            return IX_BAD_KEY;
        }
    return IX_OK;
}

static ix_status check_distinct(const ix_key *keys, int64_t n, ix_refusal *why) {
    int64_t *first = malloc((size_t)(n ? n : 1) * sizeof *first);
    if (first == NULL) return IX_NOMEM;
    int64_t repeats = ix_batch_firsts(keys, n, first);
    free(first);
    if (repeats < 0) return IX_NOMEM;
    why->count = repeats;
    return repeats ? IX_REPEATS : IX_OK;
}

/* Copies of the long keys among ``pos``, made before anything changes (NULL for short keys). */
static ix_status copy_long(ix_index *ix, const ix_key *keys, const int64_t *pos, int64_t n,
                           uint8_t **copies) {
    for (int64_t j = 0; j < n; j++) {
        const ix_key *k = &keys[pos[j]];
        copies[j] = NULL;
        if (k->tag != IX_TAG_LONG) continue;
        if (ix->full == NULL && (ix->full = calloc(ix->num_slots, sizeof *ix->full)) == NULL)
            return IX_NOMEM;
        if ((copies[j] = malloc(8 + k->len)) == NULL) return IX_NOMEM;
        uint64_t len = k->len;
        memcpy(copies[j], &len, 8);
        memcpy(copies[j] + 8, k->full, k->len);
    }
    return IX_OK;
}

static int by_slot(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* ``n`` slots off the free stack, ascending: one call's blocks land in runs of consecutive slots
 * wherever free slots are adjacent, and a load moves a run as one 2D copy per layer slice where
 * scattered slots cost a copy descriptor each (kvoffload/transfer/cuda/native/pipeline.c). */
static void take_ascending(ix_index *ix, int64_t *out, int64_t n) {
    int up = 1, down = 1;
    for (int64_t j = 0; j < n; j++) {
        out[j] = ix->free[--ix->num_free];
        if (j && out[j] < out[j - 1]) up = 0;
        if (j && out[j] > out[j - 1]) down = 0;
    }
    if (up) return;
    if (down) { /* slots evicted tail first (the policy's order) come back descending */
        for (int64_t a = 0, b = n - 1; a < b; a++, b--) {
            int64_t t = out[a];
            out[a] = out[b];
            out[b] = t;
        }
        return;
    }
    qsort(out, (size_t)n, sizeof *out, by_slot);
}

ix_status ix_prepare_store(ix_index *ix, const ix_key *keys, int64_t n, ix_plan *plan,
                           ix_refusal *why) {
    memset(plan, 0, sizeof *plan);
    ix_status st = check_keys(keys, n, why);
    if (st == IX_OK) st = check_distinct(keys, n, why);
    if (st != IX_OK) return st;
    plan->pos = malloc((size_t)(n ? n : 1) * sizeof *plan->pos);
    plan->slots = malloc((size_t)(n ? n : 1) * sizeof *plan->slots);
    uint8_t **copies = calloc((size_t)(n ? n : 1), sizeof *copies);
    uint32_t *held = malloc((size_t)(n ? n : 1) * sizeof *held); /* slots of keys present */
    if (plan->pos == NULL || plan->slots == NULL || copies == NULL || held == NULL)
        st = IX_NOMEM;
    int64_t fresh = 0, n_held = 0;
    for (int64_t i = 0; i < n && st == IX_OK; i++) {
        uint32_t s = ix_find_at(ix, keys, n, i);
        if (s == IX_NIL)
            plan->pos[fresh++] = i;
        else
            held[n_held++] = s;
    }
    int64_t short_by = fresh > ix->num_free ? fresh - ix->num_free : 0;
    if (st == IX_OK) st = copy_long(ix, keys, plan->pos, fresh, copies);
    if (st == IX_OK) st = out_alloc(plan, short_by);
    if (st == IX_OK && short_by) { /* never evict a block of this same call */
        for (int64_t h = 0; h < n_held; h++) /* the slots the lookup above found */
            if (readable(ix, held[h])) ix->e[held[h]].mark = 1;
        st = evict(ix, short_by, 1, ix->window, plan);
        for (int64_t h = 0; h < n_held; h++) ix->e[held[h]].mark = 0;
    }
    int64_t fit = fresh < ix->num_free ? fresh : ix->num_free, j = 0;
    if (st == IX_OK) take_ascending(ix, plan->slots, fit);
    for (; j < fit && st == IX_OK; j++) {
        const ix_key *k = &keys[plan->pos[j]];
        uint32_t s = (uint32_t)plan->slots[j];
        ix_entry *e = &ix->e[s];
        memcpy(e->b, k->b, IX_KEY_BYTES);
        e->tag = k->tag;
        e->state = IX_WRITING;
        e->readers = 0;
        if (copies[j] != NULL) {
            ix->full[s] = copies[j];
            copies[j] = NULL;
        }
        st = ix_table_add(&ix->table, k->hash, s);
        ix->num_writing++;
    }
    for (int64_t r = fit - 1; r >= j && st != IX_OK; r--) /* taken, not given: back on the stack */
        ix->free[ix->num_free++] = (uint32_t)plan->slots[r];
    /* Keys held already count as used, last key first (ix_acquire): the engine has just offered
     * them again. Left old, a block in the middle of a stored prefix would go before the blocks
     * around it, and a later hit would stop there (benchmarks/host_hits_sim.py). Marked above,
     * none was evicted; a WRITING one is not in the policy's lists yet. */
    for (int64_t h = n_held - 1; h >= 0 && st == IX_OK; h--)
        if (readable(ix, held[h])) ix_policy_touch(ix, held[h]);
    free(held);
    for (int64_t j = 0; j < fresh && copies; j++) free(copies[j]);
    free(copies);
    plan->n = fit;
    plan->skipped_present = n - fresh;
    plan->skipped_full = fresh - fit;
    return st;
}

/* The slots of ``keys``, all of them in ``state`` and distinct: the common case, found with one
 * lookup per key and the entries' marks for repeats. 0 if not so (the caller then words the
 * refusal the slow way). */
static int all_distinct_in(ix_index *ix, const ix_key *keys, int64_t n, int state,
                           uint32_t *slots) {
    int64_t i = 0;
    for (; i < n; i++) {
        uint32_t s = slots[i] = ix_find_at(ix, keys, n, i);
        if (s == IX_NIL || ix->e[s].state != state || ix->e[s].mark) break;
        ix->e[s].mark = 1;
    }
    for (int64_t j = 0; j < i; j++) ix->e[slots[j]].mark = 0;
    return i == n;
}

/* A store's end for slots found WRITING and distinct: readable, or back to free. */
static ix_status finish_store(ix_index *ix, const uint32_t *slots, int64_t n, int success) {
    ix_status st = IX_OK;
    if (success) { /* last key first: a prefix's head ends up the most recent (ix_acquire) */
        for (int64_t i = n - 1; i >= 0 && st == IX_OK; i--) {
            ix->num_writing--;
            ix->e[slots[i]].state = IX_READABLE;
            ix->num_readable++;
            st = ix_policy_insert(ix, slots[i]);
        }
        return st;
    }
    uint32_t from = ix->num_free;
    for (int64_t i = 0; i < n; i++) {
        uint32_t s = slots[i];
        ix->num_writing--;
        ix_table_del(&ix->table, ix_key_hash(ix->e[s].b, ix->e[s].tag), s);
        if (ix->full) {
            free(ix->full[s]);
            ix->full[s] = NULL;
        }
        memset(&ix->e[s], 0, sizeof ix->e[s]);
        ix->free[ix->num_free++] = s;
    }
    freed_in_order(ix, from);
    return st;
}

ix_status ix_complete_store(ix_index *ix, const ix_key *keys, int64_t n, int success,
                            ix_refusal *why) {
    uint32_t *slots = malloc((size_t)(n ? n : 1) * sizeof *slots);
    if (slots == NULL) return IX_NOMEM;
    ix_status st = IX_OK;
    if (!all_distinct_in(ix, keys, n, IX_WRITING, slots)) {
        st = check_distinct(keys, n, why);
        why->count = 0;
        why->first = -1;
        for (int64_t i = 0; i < n && st == IX_OK; i++) {
            uint32_t s = ix_find(ix, &keys[i]);
            if ((s == IX_NIL || ix->e[s].state != IX_WRITING) && why->count++ == 0) why->first = i;
        }
        if (st == IX_OK) st = why->count ? IX_NOT_WRITING : IX_NOMEM; /* NOMEM: cannot happen */
        free(slots);
        return st;
    }
    st = finish_store(ix, slots, n, success);
    free(slots);
    return st;
}

/* The given slots, all in ``state`` (READABLE: with a reader) and, where ``distinct``, none
 * repeated, as uint32 ids in ``out``; the first that is not so in ``why`` (nothing changed). */
static ix_status slots_in(ix_index *ix, const int64_t *given, int64_t n, int state, int distinct,
                          uint32_t *out, ix_refusal *why) {
    int64_t i = 0;
    for (; i < n; i++) {
        int64_t s = given[i];
        if (s < 0 || s >= ix->num_slots || ix->e[s].state != state ||
            (state == IX_READABLE && ix->e[s].readers == 0) || (distinct && ix->e[s].mark))
            break;
        out[i] = (uint32_t)s;
        if (distinct) ix->e[s].mark = 1;
    }
    for (int64_t j = 0; distinct && j < i; j++) ix->e[out[j]].mark = 0;
    if (i == n) return IX_OK;
    why->count = 1;
    why->first = i;
    return state == IX_WRITING ? IX_NOT_WRITING : IX_FEW_READERS;
}

ix_status ix_complete_slots(ix_index *ix, const int64_t *given, int64_t n, int success,
                            ix_refusal *why) {
    uint32_t *slots = malloc((size_t)(n ? n : 1) * sizeof *slots);
    if (slots == NULL) return IX_NOMEM;
    ix_status st = slots_in(ix, given, n, IX_WRITING, 1, slots, why);
    if (st == IX_OK) st = finish_store(ix, slots, n, success);
    free(slots);
    return st;
}

/* -- readers ----------------------------------------------------------------------------------- */

ix_status ix_acquire(ix_index *ix, const ix_key *keys, int64_t n, int touch, int64_t *slots,
                     ix_refusal *why) {
    why->count = 0;
    why->first = -1;
    for (int64_t i = 0; i < n; i++) {
        uint32_t s = ix_find_at(ix, keys, n, i);
        slots[i] = s;
        if (!readable(ix, s) && why->count++ == 0) why->first = i;
    }
    if (why->count) return IX_NOT_READABLE;
    for (int64_t i = 0; i < n; i++)
        if (ix->e[slots[i]].readers++ == 0) ix->num_pinned++;
    if (touch) /* last key first: of a prefix the head, which every longer prefix needs, is
                * the most recent and the tail goes first (as vLLM's offloading managers) */
        for (int64_t i = n - 1; i >= 0; i--) ix_policy_touch(ix, (uint32_t)slots[i]);
    return IX_OK;
}

/* The refusal of a release that would drop more readers than a key has: how many distinct keys,
 * and the first (in the order of their first occurrence). */
static ix_status release_refusal(ix_index *ix, const ix_key *keys, int64_t n, ix_refusal *why) {
    int64_t *first = malloc((size_t)(n ? n : 1) * 2 * sizeof *first);
    if (first == NULL || ix_batch_firsts(keys, n, first) < 0) {
        free(first);
        return IX_NOMEM;
    }
    int64_t *times = first + n; /* at a key's first position: how often it is released */
    for (int64_t i = 0; i < n; i++) times[i] = 0;
    for (int64_t i = 0; i < n; i++) times[first[i]]++;
    why->count = 0;
    why->first = -1;
    for (int64_t i = 0; i < n; i++) {
        if (first[i] != i) continue;
        uint32_t s = ix_find(ix, &keys[i]);
        int64_t have = readable(ix, s) ? ix->e[s].readers : 0;
        if (have < times[i] && why->count++ == 0) why->first = i;
    }
    free(first);
    return IX_FEW_READERS;
}

/* Drop one reader of each slot (one may repeat); at the first that has none left, undo them all
 * and return its position (n: every one dropped). */
static int64_t drop_readers(ix_index *ix, const uint32_t *slots, int64_t n) {
    int64_t i = 0;
    for (; i < n; i++) {
        if (ix->e[slots[i]].readers == 0) break;
        ix->e[slots[i]].readers--;
    }
    if (i < n) {
        for (int64_t j = 0; j < i; j++) ix->e[slots[j]].readers++;
        return i;
    }
    for (int64_t j = 0; j < n; j++) /* a slot released twice is counted unpinned once */
        if (ix->e[slots[j]].readers == 0 && !ix->e[slots[j]].mark) {
            ix->e[slots[j]].mark = 1;
            ix->num_pinned--;
        }
    for (int64_t j = 0; j < n; j++) ix->e[slots[j]].mark = 0;
    return n;
}

ix_status ix_release(ix_index *ix, const ix_key *keys, int64_t n, ix_refusal *why) {
    uint32_t *slots = malloc((size_t)(n ? n : 1) * sizeof *slots);
    if (slots == NULL) return IX_NOMEM;
    int64_t i = 0;
    for (; i < n; i++) {
        uint32_t s = slots[i] = ix_find_at(ix, keys, n, i);
        if (!readable(ix, s)) break;
    }
    ix_status st = i == n && drop_readers(ix, slots, n) == n ? IX_OK : IX_FEW_READERS;
    free(slots);
    return st == IX_OK ? IX_OK : release_refusal(ix, keys, n, why);
}

ix_status ix_release_slots(ix_index *ix, const int64_t *given, int64_t n, ix_refusal *why) {
    uint32_t *slots = malloc((size_t)(n ? n : 1) * sizeof *slots);
    if (slots == NULL) return IX_NOMEM;
    ix_status st = slots_in(ix, given, n, IX_READABLE, 0, slots, why);
    if (st == IX_OK && drop_readers(ix, slots, n) != n) st = IX_FEW_READERS;
    free(slots);
    return st;
}

void ix_touch(ix_index *ix, const ix_key *keys, int64_t n) {
    for (int64_t i = n - 1; i >= 0; i--) { /* last key first (ix_acquire) */
        uint32_t s = ix_find_at(ix, keys, n, i);
        if (readable(ix, s)) ix_policy_touch(ix, s);
    }
}
