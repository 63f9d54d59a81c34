/* The native block index: shared declarations (kvoffload/store/index.py has the contract).
 *
 * One owner per concept, one file each: keys.c (a key as a fixed-size value), table.c (open
 * addressing from a key's hash to an id), lists.c (intrusive doubly linked lists of ids), lru.c
 * and arc.c (eviction order), policy.c (the one switch between them), batch.c (the distinct keys
 * of one call), index.c (slots, states, readers: the two-phase protocol), check.c (invariants),
 * inspect.c (the index read out), module.c (the Python binding, which only calls functions).
 * No locks: every entry point runs under the GIL and never releases it, so a call is atomic.
 * Every fallible function returns an ix_status; IX_OK is 0.
 */
#ifndef IX_H
#define IX_H

#include <stddef.h>
#include <stdint.h>

#define IX_KEY_BYTES 16     /* a key's inline value */
#define IX_TAG_NONE 0       /* not a key (not bytes, or empty): never found, never stored */
#define IX_TAG_NEG 17       /* b"-" + 16 bytes: a negative int hash (keys.py) */
#define IX_TAG_LONG 255     /* any other length: a digest inline, the bytes kept beside */
#define IX_NIL UINT32_MAX   /* no id */
#define IX_MAX_SLOTS 0x7ffffffeu  /* ARC ghosts (at most 2x) keep uint32 ids */
#define IX_LOAD_NUM 3       /* a table is at most 3/4 full */
#define IX_LOAD_DEN 4
#define IX_PREFETCH 8       /* keys ahead whose bucket a batch loop asks the cache for */

enum { IX_FREE = 0, IX_WRITING = 1, IX_READABLE = 2 };
enum { IX_LRU = 0, IX_ARC = 1 };

typedef enum {
    IX_OK = 0,
    IX_NOMEM,         /* an allocation failed */
    IX_REPEATS,       /* count: repeated keys */
    IX_NOT_WRITING,   /* count, first: keys not being written */
    IX_NOT_READABLE,  /* count, first: keys not READABLE */
    IX_FEW_READERS,   /* count, first: keys with fewer readers than released */
    IX_BAD_KEY,       /* first: a key that is not non-empty bytes */
} ix_status;

/* What went wrong, for the caller's message: how many keys, and the position of the first. */
typedef struct {
    int64_t count;
    int64_t first;
} ix_refusal;

/* -- keys.c: one key of a call, as the index compares it ------------------------------------- */
typedef struct {
    uint8_t b[IX_KEY_BYTES];
    uint8_t tag;           /* 1..16: length of a short key; IX_TAG_NEG; IX_TAG_LONG; IX_TAG_NONE */
    uint64_t hash;
    const uint8_t *full;   /* IX_TAG_LONG: the caller's bytes (valid during the call) */
    size_t len;
} ix_key;

void ix_key_set(ix_key *k, const uint8_t *p, size_t n);
void ix_key_none(ix_key *k);
uint64_t ix_key_hash(const uint8_t b[IX_KEY_BYTES], uint8_t tag);
/* The key's bytes as given: at most IX_KEY_BYTES + 1 unless long (then ``full``). */
size_t ix_key_bytes(const uint8_t b[IX_KEY_BYTES], uint8_t tag, uint8_t *out);

/* -- table.c: hash -> id, linear probing, backward-shift deletion ----------------------------- */
typedef struct {
    uint32_t fp;  /* low 32 bits of the hash (the home bucket is fp & mask) */
    uint32_t id1; /* id + 1; 0: empty */
} ix_bucket;

typedef struct {
    ix_bucket *b;
    uint64_t mask;
    uint64_t count;
} ix_table;

typedef int (*ix_match)(const void *ctx, uint32_t id);
ix_status ix_table_init(ix_table *t, uint64_t capacity);
void ix_table_free(ix_table *t);
uint32_t ix_table_find(const ix_table *t, uint64_t hash, ix_match match, const void *ctx);
void ix_table_prefetch(const ix_table *t, uint64_t hash);
ix_status ix_table_add(ix_table *t, uint64_t hash, uint32_t id); /* grows when full */
void ix_table_del(ix_table *t, uint64_t hash, uint32_t id);
size_t ix_table_nbytes(const ix_table *t);

/* -- lists.c: doubly linked lists threaded through a links array, oldest at head ------------- */
typedef struct {
    uint32_t prev, next;
} ix_link;

typedef struct {
    uint32_t head, tail;
    uint64_t len;
} ix_list;

void ix_list_init(ix_list *l);
void ix_list_push(ix_list *l, ix_link *links, uint32_t id);   /* at the tail (newest) */
void ix_list_unlink(ix_list *l, ix_link *links, uint32_t id);
uint32_t ix_list_pop(ix_list *l, ix_link *links);             /* the head; IX_NIL if empty */

/* -- policy.c, lru.c, arc.c: eviction order over slot ids ----------------------------------- */
typedef struct {
    uint8_t b[IX_KEY_BYTES];
    uint8_t tag;
    uint8_t list; /* IX_B1 or IX_B2 */
} ix_ghost;

enum { IX_T1 = 1, IX_T2 = 2, IX_B1 = 3, IX_B2 = 4 };

typedef struct ix_index ix_index;

typedef struct {
    int kind;
    uint64_t capacity;
    ix_link *links;       /* per slot */
    ix_list t1, t2;       /* LRU: t1 only */
    uint64_t p;           /* ARC: target size of T1 */
    ix_ghost *ghosts;     /* ARC: keys recently evicted (keys only), grown on demand */
    ix_link *glinks;
    uint32_t gcap, gfree; /* pool size; head of the free ids (through glinks[].next) */
    ix_list b1, b2;
    ix_table gtable;
} ix_policy;

ix_status ix_policy_init(ix_policy *pol, int kind, uint32_t capacity);
void ix_policy_free(ix_policy *pol);
ix_status ix_policy_insert(ix_index *ix, uint32_t slot);
void ix_policy_touch(ix_index *ix, uint32_t slot);
ix_status ix_policy_remove(ix_index *ix, uint32_t slot, int evicted);
/* The lists to walk for victims, best first (the second may be NULL). */
void ix_policy_order(const ix_policy *pol, const ix_list **first, const ix_list **second);
size_t ix_policy_nbytes(const ix_policy *pol);

void ix_lru_insert(ix_policy *pol, uint32_t slot);
void ix_lru_touch(ix_policy *pol, uint32_t slot);
void ix_lru_remove(ix_policy *pol, uint32_t slot);
ix_status ix_arc_init(ix_policy *pol);
ix_status ix_arc_insert(ix_index *ix, uint32_t slot);
void ix_arc_touch(ix_index *ix, uint32_t slot);
ix_status ix_arc_remove(ix_index *ix, uint32_t slot, int evicted);

/* -- batch.c: the distinct keys of one call ------------------------------------------------- */
/* For each position, the first position holding an equal key (first[i] == i: its first
 * occurrence); returns how many positions repeat an earlier one, or -1 (no memory). Keys with
 * IX_TAG_NONE are never equal to another. */
int64_t ix_batch_firsts(const ix_key *keys, int64_t n, int64_t *first);
int ix_key_equal(const ix_key *a, const ix_key *b);

/* -- index.c: slots, states and readers ------------------------------------------------------- */
typedef struct {
    uint8_t b[IX_KEY_BYTES];
    uint8_t tag;     /* IX_TAG_NONE while the slot is FREE */
    uint8_t state;   /* IX_FREE, IX_WRITING, IX_READABLE */
    uint8_t list;    /* the policy list holding it (READABLE only) */
    uint8_t mark;    /* protected from eviction during one prepare_store */
    uint32_t readers;
} ix_entry;

struct ix_index {
    uint32_t num_slots;
    ix_entry *e;
    uint8_t **full;   /* per slot, a long key's bytes (8-byte length, then the bytes); lazy */
    uint32_t *free;   /* stack of free slots, top at num_free - 1 */
    uint32_t num_free, num_writing, num_readable, num_pinned;
    ix_table table;   /* WRITING and READABLE keys -> slot */
    ix_policy pol;
    uint32_t window;  /* a store's victims come from the policy's first want x window (runs.c) */
};

/* What one prepare_store decided. Arrays are allocated by the index, freed with ix_plan_free. */
typedef struct {
    int64_t *pos;     /* positions (in the call's keys) of the keys given slots, in order */
    int64_t *slots;
    int64_t n;
    ix_key *ev_keys;   /* the keys evicted (or removed), in order */
    uint8_t **ev_full; /* long keys' bytes, owned by the plan */
    int64_t n_evicted;
    int64_t skipped_present, skipped_full;
} ix_plan;

ix_status ix_init(ix_index *ix, uint32_t num_slots, int policy);
void ix_free(ix_index *ix);
size_t ix_nbytes(const ix_index *ix);
uint32_t ix_find(const ix_index *ix, const ix_key *k); /* slot, or IX_NIL */
/* ix_find of keys[i], with the bucket of keys[i + IX_PREFETCH] prefetched (a batch's loop). */
uint32_t ix_find_at(const ix_index *ix, const ix_key *keys, int64_t n, int64_t i);
int64_t ix_lookup(ix_index *ix, const ix_key *keys, int64_t n);
ix_status ix_prepare_store(ix_index *ix, const ix_key *keys, int64_t n, ix_plan *plan,
                           ix_refusal *why);
void ix_plan_free(ix_plan *plan);
ix_status ix_complete_store(ix_index *ix, const ix_key *keys, int64_t n, int success,
                            ix_refusal *why);
ix_status ix_acquire(ix_index *ix, const ix_key *keys, int64_t n, int touch, int64_t *slots,
                     ix_refusal *why);
ix_status ix_release(ix_index *ix, const ix_key *keys, int64_t n, ix_refusal *why);
/* complete_store and release by the slots prepare_store / prepare_load gave (the caller's record
 * of a job), without finding the keys again: a WRITING (distinct) or READABLE slot with a reader
 * each, else a refusal (count 1, first: the position) before anything changed. */
ix_status ix_complete_slots(ix_index *ix, const int64_t *slots, int64_t n, int success,
                            ix_refusal *why);
ix_status ix_release_slots(ix_index *ix, const int64_t *slots, int64_t n, ix_refusal *why);
void ix_touch(ix_index *ix, const ix_key *keys, int64_t n);
/* Evict up to n (victims) or drop the given keys (remove); the dropped keys go to ``out``. */
ix_status ix_evict(ix_index *ix, int64_t n, ix_plan *out);
ix_status ix_remove(ix_index *ix, const ix_key *keys, int64_t n, int all, ix_plan *out);
/* runs.c: of ``n`` > ``want`` candidate slots in the policy's order, keep in ``victims[0..want)``
 * the ``want`` taken by runs of consecutive slots, in the policy's order. */
ix_status ix_choose_runs(uint32_t *victims, int64_t n, int64_t want);
#define IX_MAX_WINDOW 1024u
#define IX_WINDOW_SHARE 16 /* a window reaches at most num_slots / 16 past the exact victims */
const char *ix_check(const ix_index *ix); /* NULL, or what contradicts itself */

/* -- ids.c: engine block ids of a transfer --------------------------------------------------- */
/* 1 if every id is in [0, upper) (upper < 0: only >= 0) and, with want_distinct, none repeats;
 * 0 if not; -1 out of memory. */
int ix_ids_fit(const int64_t *v, int64_t n, int64_t upper, int want_distinct);

/* -- inspect.c: the index read out, for the binding ---------------------------------------- */
typedef struct {
    int state;
    int64_t slot; /* -1: absent */
    uint32_t readers;
} ix_status_of;

/* Keys copied out of the index (the caller may then run code that changes it). */
typedef struct {
    ix_key *keys;
    uint8_t **full; /* long keys' bytes (8-byte length first), copied; NULL for the others */
    int64_t n;
} ix_keylist;

#define IX_POLICY_LISTS 6 /* victim order (first list, then second), T1, T2, B1, B2 */

ix_status_of ix_state_of(const ix_index *ix, const ix_key *k);
void ix_counts(const ix_index *ix, uint32_t out[4]); /* free, writing, readable, pinned */
ix_status ix_policy_lists(const ix_index *ix, ix_keylist out[IX_POLICY_LISTS], uint64_t *p);
void ix_keylist_free(ix_keylist *l);

#endif
