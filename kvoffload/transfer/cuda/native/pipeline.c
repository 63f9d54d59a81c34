/* The staged pipeline of one job, enqueued by its direction's worker thread (no GIL, no Python).
 *
 * A store gathers each chunk of blocks with the copy kernel into a device staging area laid out
 * like host slots, then moves the chunk with one copy-engine descriptor per block (consecutive
 * slots merged). A load does the reverse, layer-major: per layer slice, one descriptor per block
 * into staging, then the scatter; the slice's event is recorded after its last scatter. Chunks go
 * round a ring of `depth` staging areas; `filled` / `freed` events hand an area between the
 * kernels' stream and the DMA stream(s), so the gather of chunk k+1 overlaps the DMA of chunk k.
 * Chunks double from `first_chunk_bytes` (stores; loads shrink toward the end) so the one exposed
 * gather (or scatter) is short. The same steps, in Python, are kvoffload/transfer/cuda/staged.py
 * (the fallback and the oracle the CPU tests compare call orders with).
 */
#include <stdlib.h>
#include <string.h>

#include "kvo.h"

/* CUmemcpyAttributes: source read in stream order (the copies wait for the work enqueued ahead
 * of them on the stream; that is how a store's DMA waits for its gather). */
static struct { int order; int src_type, src_id, dst_type, dst_id; unsigned flags; } attrs = {1, 0, 0, 0, 0, 0};
static size_t attr_index[1] = {0};

#define TRY(call, step, chunk)                                                      \
    do {                                                                            \
        int err_ = (call);                                                          \
        if (err_) return kvo_fail(job, &e->d, err_, (step), (chunk), -1, NULL);     \
    } while (0)

static int grow(int64_t **p, int64_t *cap, int64_t need, int count) {
    if (need <= *cap) return 0;
    int64_t n = need > 2 * *cap ? need : 2 * *cap;
    for (int k = 0; k < count; k++) {
        int64_t *q = realloc(p[k], (size_t)n * sizeof(int64_t));
        if (q == NULL) return -1;
        p[k] = q;
    }
    *cap = n;
    return 0;
}

typedef struct {
    kvo_engine *e;
    kvo_job *job;
    kvo_lane *lane;
    const kvo_part *part;
    const kvo_kernel *kernel;
    const int64_t *slots;
    kvo_dptr blocks;
    int64_t n_chunks, depth, position, descs_before;
    int whole; /* whole host slots move: consecutive slots merge into one descriptor */
} part_run;

static int64_t area_of(const part_run *r, int64_t c) { return (r->position + c) % r->depth; }

static int copies(part_run *r, int64_t c, kvo_stream stream) {
    kvo_engine *e = r->e;
    kvo_job *job = r->job;
    kvo_lane *lane = r->lane;
    const kvo_spec *s = &e->spec;
    int64_t start = lane->starts[c], count = lane->sizes[c], unit = r->part->unit;
    int64_t base = s->bases[job->dir][area_of(r, c)], n = 0;
    int store = job->dir == KVO_STORE;
    for (int64_t i = 0; i < count; i++) {
        int64_t slot = r->slots[start + i];
        int64_t host = s->arena_base + slot * s->arena_slot_bytes + r->part->offset;
        int64_t staged = base + i * unit;
        if (r->whole && n > 0 && slot == r->slots[start + i - 1] + 1) {
            lane->len[n - 1] += unit;
            continue;
        }
        lane->src[n] = store ? staged : host;
        lane->dst[n] = store ? host : staged;
        lane->len[n] = unit;
        n++;
    }
    if (e->d.batch == NULL || n == 1) { /* one copy: cuMemcpyAsync costs a third of a batch */
        for (int64_t i = 0; i < n; i++) {
            int err = e->d.copy((kvo_dptr)lane->dst[i], (kvo_dptr)lane->src[i],
                                (size_t)lane->len[i], stream);
            if (err)
                return kvo_fail(job, &e->d, err, STEP_COPY, c, r->descs_before + i, NULL);
        }
    } else {
        size_t fail = SIZE_MAX;
        int err = e->d.batch(lane->dst, lane->src, lane->len, (size_t)n, &attrs, attr_index, 1,
                             &fail, stream);
        if (err)
            return kvo_fail(job, &e->d, err, STEP_COPY, c,
                            fail < (size_t)n ? r->descs_before + (int64_t)fail : -1, NULL);
    }
    r->descs_before += n;
    return 0;
}

static int fits32(int64_t v) { return v >= -2147483648LL && v <= 2147483647LL; }

static int launch(part_run *r, int64_t c) {
    kvo_engine *e = r->e;
    kvo_job *job = r->job;
    const kvo_kernel *k = r->kernel;
    int64_t ints[5] = {r->lane->starts[c], r->lane->sizes[c], r->part->n_regions,
                       e->spec.bases[job->dir][area_of(r, c)], r->part->unit};
    union { int32_t i32; int64_t i64; uint64_t ptr; } arg[8];
    uint64_t none = 0;
    void *params[16];
    arg[0].ptr = r->blocks;
    arg[1].ptr = r->blocks; /* slots: unused, the staging area is indexed by position */
    arg[2].ptr = (uint64_t)r->part->regions;
    for (int j = 0; j < 5; j++) {
        if (k->wide >> j & 1) {
            arg[3 + j].i64 = ints[j];
        } else {
            if (!fits32(ints[j]))
                return kvo_fail(job, &e->d, 1, STEP_ARG, c, -1,
                                "a copy-kernel argument does not fit the compiled variant's i32");
            arg[3 + j].i32 = (int32_t)ints[j];
        }
    }
    for (int j = 0; j < 8; j++) params[j] = &arg[j];
    for (int j = 8; j < 16; j++) params[j] = &none;
    int err = e->d.launch((void *)k->function, (unsigned)k->grid, 1, 1, (unsigned)k->block, 1, 1,
                          (unsigned)k->shared, (kvo_stream)e->spec.gather[job->dir], params, NULL);
    return err ? kvo_fail(job, &e->d, err, STEP_LAUNCH, c, -1, NULL) : 0;
}

/* A store's chunk: once its area is free, gather into it, mark it filled. */
static int gather(part_run *r, int64_t c) {
    kvo_engine *e = r->e;
    kvo_job *job = r->job;
    kvo_stream g = (kvo_stream)e->spec.gather[job->dir];
    int64_t area = area_of(r, c);
    TRY(e->d.wait(g, r->lane->freed[area], 0), STEP_WAIT, c);
    int err = launch(r, c);
    if (err) return err;
    TRY(e->d.record(r->lane->filled[area], g), STEP_RECORD, c);
    return 0;
}

/* A load's chunk: once its area is free, DMA the slots into it, mark it filled. */
static int send(part_run *r, int64_t c) {
    kvo_engine *e = r->e;
    kvo_job *job = r->job;
    kvo_stream dma = (kvo_stream)e->spec.dmas[job->dir][c % e->spec.n_dmas];
    int64_t area = area_of(r, c);
    TRY(e->d.wait(dma, r->lane->freed[area], 0), STEP_WAIT, c);
    int err = copies(r, c, dma);
    if (err) return err;
    TRY(e->d.record(r->lane->filled[area], dma), STEP_RECORD, c);
    return 0;
}

/* Chunk sizes (kvoffload.transfer.cuda.chunks.chunk_blocks): doubling from the first chunk's
 * bytes up to one staging area; a load's ramp runs the other way. */
static int plan_chunks(kvo_engine *e, kvo_lane *lane, int64_t n, int64_t unit, int store,
                       int64_t *chunks) {
    int64_t largest = e->spec.area_bytes / unit, first = e->spec.first_chunk_bytes / unit;
    if (first < 1) first = 1;
    if (first > largest) first = largest;
    int64_t *arrays[2] = {lane->sizes, lane->starts};
    if (grow(arrays, &lane->scratch_chunks, n + 1, 2) != 0) return -1;
    lane->sizes = arrays[0];
    lane->starts = arrays[1];
    int64_t m = 0, left = n, size = first;
    while (left > 0) {
        int64_t t = size < left ? size : left;
        lane->sizes[m++] = t;
        left -= t;
        size = size * 2 < largest ? size * 2 : largest;
    }
    if (!store)
        for (int64_t i = 0; i < m / 2; i++) {
            int64_t t = lane->sizes[i];
            lane->sizes[i] = lane->sizes[m - 1 - i];
            lane->sizes[m - 1 - i] = t;
        }
    for (int64_t i = 0, at = 0; i < m; i++) {
        lane->starts[i] = at;
        at += lane->sizes[i];
    }
    *chunks = m;
    return 0;
}

/* Every chunk of one spec's part: the chunk loop of the staged path. */
static int enqueue_part(kvo_engine *e, kvo_job *job, int64_t s, const kvo_part *part,
                        kvo_dptr blocks) {
    int64_t n = job->count[s];
    if (n == 0) return 0;
    kvo_lane *lane = &e->lane[job->dir];
    const kvo_group *g = &e->spec.groups[job->group[s]];
    int store = job->dir == KVO_STORE;
    int64_t m = 0;
    if (plan_chunks(e, lane, n, part->unit, store, &m) != 0)
        return kvo_fail(job, &e->d, 2, STEP_ALLOC, -1, -1, "out of host memory (chunk plan)");
    int64_t *desc[3] = {lane->src, lane->dst, lane->len};
    if (grow(desc, &lane->scratch_desc, n, 3) != 0)
        return kvo_fail(job, &e->d, 2, STEP_ALLOC, -1, -1, "out of host memory (descriptors)");
    lane->src = desc[0];
    lane->dst = desc[1];
    lane->len = desc[2];
    part_run r = {e, job, lane, part, &g->kernel[job->dir], job->ids + job->at[s] + n, blocks,
                  m, e->spec.depth, lane->position, 0,
                  part->offset == 0 && part->unit == e->spec.arena_slot_bytes};
    lane->position = (lane->position + m) % e->spec.depth;
    int64_t ahead = e->spec.depth < m ? e->spec.depth : m;
    int err;
    kvo_stream gs = (kvo_stream)e->spec.gather[job->dir];
    if (store) {
        for (int64_t c = 0; c < ahead; c++)
            if ((err = gather(&r, c))) return err;
        for (int64_t c = 0; c < m; c++) {
            int64_t area = area_of(&r, c);
            kvo_stream dma = (kvo_stream)e->spec.dmas[KVO_STORE][c % e->spec.n_dmas];
            TRY(e->d.wait(dma, lane->filled[area], 0), STEP_WAIT, c);
            if ((err = copies(&r, c, dma))) return err;
            TRY(e->d.record(lane->freed[area], dma), STEP_RECORD, c);
            if (c + ahead < m && (err = gather(&r, c + ahead))) return err;
        }
    } else {
        for (int64_t c = 0; c < ahead; c++)
            if ((err = send(&r, c))) return err;
        for (int64_t c = 0; c < m; c++) {
            int64_t area = area_of(&r, c);
            TRY(e->d.wait(gs, lane->filled[area], 0), STEP_WAIT, c);
            if ((err = launch(&r, c))) return err;
            TRY(e->d.record(lane->freed[area], gs), STEP_RECORD, c);
            if (c + ahead < m && (err = send(&r, c + ahead))) return err;
        }
    }
    e->native_parts++;
    return 0;
}

/* A device buffer of block ids for this job (ring of KVO_INDEX_RING, reused once the GPU is done
 * with its previous job), filled from a pinned twin by one copy on the kernels' stream. */
static int upload_ids(kvo_engine *e, kvo_job *job, kvo_lane *lane, int *entry, kvo_dptr *dev) {
    int64_t k = lane->index_pos++ % KVO_INDEX_RING;
    *entry = (int)k;
    if (lane->index[k].used) TRY(e->d.event_sync(lane->index[k].idle), STEP_WAIT, -1);
    lane->index[k].used = 0;
    int64_t need = job->total > 0 ? job->total : 1;
    if (lane->index[k].capacity < need) {
        int64_t cap = lane->index[k].capacity * 2;
        if (cap < 2 * need) cap = 2 * need;
        if (lane->index[k].host != NULL) e->d.host_free(lane->index[k].host);
        if (lane->index[k].dev != 0) e->d.mem_free(lane->index[k].dev);
        lane->index[k].host = NULL;
        lane->index[k].dev = 0;
        lane->index[k].capacity = 0;
        TRY(e->d.host_alloc(&lane->index[k].host, (size_t)cap * 8, 0), STEP_ALLOC, -1);
        TRY(e->d.mem_alloc(&lane->index[k].dev, (size_t)cap * 8), STEP_ALLOC, -1);
        lane->index[k].capacity = cap;
    }
    int64_t *host = lane->index[k].host;
    int64_t at = 0;
    for (int64_t s = 0; s < job->n_specs; s++) {
        memcpy(host + at, job->ids + job->at[s], (size_t)job->count[s] * 8);
        at += job->count[s];
    }
    lane->index[k].used = 1;
    if (at <= KVO_HOST_IDS) { /* the kernels read the few ids from pinned host memory (UVA): no
                                * copy to wait for; the buffer stays ours until they finish */
        *dev = (kvo_dptr)(uintptr_t)host;
        return 0;
    }
    *dev = lane->index[k].dev;
    TRY(e->d.copy(*dev, (kvo_dptr)(uintptr_t)host, (size_t)at * 8,
                  (kvo_stream)e->spec.gather[job->dir]),
        STEP_COPY, -1);
    return 0;
}

static int run_parts(kvo_engine *e, kvo_job *job, kvo_dptr ids) {
    int err;
    kvo_lane *lane = &e->lane[job->dir];
    if (job->dir == KVO_STORE) {
        kvo_dptr at = ids;
        for (int64_t s = 0; s < job->n_specs; s++) {
            const kvo_group *g = &e->spec.groups[job->group[s]];
            if ((err = enqueue_part(e, job, s, &g->parts[0], at))) return err;
            at += (kvo_dptr)job->count[s] * 8;
        }
        for (int64_t j = 1; j < e->spec.n_dmas; j++) { /* the tail waits for the other DMAs */
            TRY(e->d.record(lane->joins[j], (kvo_stream)e->spec.dmas[KVO_STORE][j]), STEP_RECORD, -1);
            TRY(e->d.wait((kvo_stream)e->spec.dmas[KVO_STORE][0], lane->joins[j], 0), STEP_WAIT, -1);
        }
        return 0;
    }
    for (int64_t k = 0; k < job->n_slices; k++) {
        kvo_dptr at = ids;
        for (int64_t s = 0; s < job->n_specs; s++) {
            const kvo_group *g = &e->spec.groups[job->group[s]];
            if (k < job->plan_count[s] &&
                (err = enqueue_part(e, job, s, &g->parts[job->plan_first[s] + k], at)))
                return err;
            at += (kvo_dptr)job->count[s] * 8;
        }
        TRY(e->d.record(job->slices[k], (kvo_stream)e->spec.gather[KVO_LOAD]), STEP_RECORD, -1);
        pthread_mutex_lock(&e->mu);
        if (k == 0) job->t_first_slice = kvo_now();
        job->recorded = k + 1;
        pthread_cond_broadcast(&e->changed);
        pthread_mutex_unlock(&e->mu);
    }
    return 0;
}

/* The whole per-transfer path after submit: order, ids, chunks, events. 0 or the first error
 * (details in the job); the job's done event is recorded whatever happened, so completion is
 * detected the same way (a failed job is reported once the work it did enqueue has finished). */
int kvo_run_job(kvo_engine *e, kvo_job *job) {
    int dir = job->dir, err = 0, entry = -1;
    kvo_lane *lane = &e->lane[dir];
    kvo_stream gs = (kvo_stream)e->spec.gather[dir];
    kvo_stream tail = dir == KVO_STORE ? (kvo_stream)e->spec.dmas[KVO_STORE][0] : gs;
    kvo_dptr ids = 0;
    if (job->order != NULL) { /* only the kernels touch the engine's memory: their stream waits
                                 * for the caller's work; the DMA streams follow the kernels */
        err = e->d.wait(gs, job->order, 0);
        if (err) kvo_fail(job, &e->d, err, STEP_WAIT, -1, -1, "the wait for the caller's stream");
    }
    if (!err) err = upload_ids(e, job, lane, &entry, &ids);
    if (!err) err = run_parts(e, job, ids);
    if (entry >= 0 && lane->index[entry].used) {
        int rec = e->d.record(lane->index[entry].idle, gs);
        if (rec) { /* never reuse a buffer we cannot track: wait for the stream instead */
            e->d.stream_sync(gs);
            lane->index[entry].used = 0;
        }
    }
    if (dir == KVO_LOAD && err) { /* waiters of unrecorded slices wait for the done event */
        pthread_mutex_lock(&e->mu);
        pthread_cond_broadcast(&e->changed);
        pthread_mutex_unlock(&e->mu);
    }
    int rec = e->d.record(job->done_ev, tail);
    job->done_recorded = rec == 0;
    if (rec) {
        kvo_fail(job, &e->d, rec, STEP_RECORD, -1, -1, "the transfer's completion event");
        for (int64_t j = 0; j < e->spec.n_dmas; j++) e->d.stream_sync((kvo_stream)e->spec.dmas[dir][j]);
        e->d.stream_sync(gs);
        return rec;
    }
    return err;
}

int kvo_lane_init(kvo_engine *e, int dir) {
    kvo_lane *lane = &e->lane[dir];
    memset(lane, 0, sizeof *lane);
    for (int64_t a = 0; a < e->spec.depth; a++) {
        int err = e->d.event_create(&lane->filled[a], 2);
        if (!err) err = e->d.event_create(&lane->freed[a], 2);
        if (err) return err;
    }
    for (int64_t j = 0; j < e->spec.n_dmas; j++) {
        int err = e->d.event_create(&lane->joins[j], 2);
        if (err) return err;
    }
    for (int k = 0; k < KVO_INDEX_RING; k++) { /* allocated now: pinning memory takes
                                                  * milliseconds, which no transfer should wait */
        int err = e->d.event_create(&lane->index[k].idle, 2);
        if (!err) err = e->d.host_alloc(&lane->index[k].host, KVO_INDEX_FIRST * 8, 0);
        if (!err) err = e->d.mem_alloc(&lane->index[k].dev, KVO_INDEX_FIRST * 8);
        if (err) return err;
        lane->index[k].capacity = KVO_INDEX_FIRST;
    }
    return 0;
}

void kvo_lane_free(kvo_engine *e, kvo_lane *lane) {
    for (int64_t a = 0; a < 64; a++) {
        if (lane->filled[a]) e->d.event_destroy(lane->filled[a]);
        if (lane->freed[a]) e->d.event_destroy(lane->freed[a]);
    }
    for (int j = 0; j < KVO_MAX_DMAS; j++)
        if (lane->joins[j]) e->d.event_destroy(lane->joins[j]);
    for (int k = 0; k < KVO_INDEX_RING; k++) {
        if (lane->index[k].idle) e->d.event_destroy(lane->index[k].idle);
        if (lane->index[k].host) e->d.host_free(lane->index[k].host);
        if (lane->index[k].dev) e->d.mem_free(lane->index[k].dev);
    }
    free(lane->sizes);
    free(lane->starts);
    free(lane->src);
    free(lane->dst);
    free(lane->len);
    memset(lane, 0, sizeof *lane);
}
