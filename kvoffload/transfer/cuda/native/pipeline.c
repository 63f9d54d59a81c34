/* The staged pipeline of one job (pipeline.h), enqueued whole by the thread that runs it.
 * A store gathers each chunk of blocks with the copy kernel into a device staging area laid out
 * like host slots, then moves the chunk with one copy-engine descriptor per block (consecutive
 * slots merged). A load does the reverse, layer-major: per layer slice, one descriptor per block
 * into staging, then the scatter, then a write of the job's sequence number into the flag word
 * of every layer of that slice (flags.h), which is what an engine stream waiting for that layer
 * waits on. Chunks go round a ring of `depth` staging areas; `filled` / `freed` events hand an
 * area between the kernels' stream and the DMA stream(s), so the gather of chunk k+1 overlaps
 * the DMA of chunk k; the ring's reuse is ordered on the GPU (chunk sizes: plan_chunks). */
#include "part.h"

#define TRY(call, step, chunk)                                                      \
    do {                                                                            \
        int err_ = (call);                                                          \
        if (err_) return kvo_job_fail(job, p->d, err_, (step), (chunk), -1, NULL);  \
    } while (0)

static int fits32(int64_t v) { return v >= -2147483648LL && v <= 2147483647LL; }

static int launch_on(part_run *r, int64_t c, kvo_stream stream) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    const kvo_kernel *k = &r->group->kernel[job->dir];
    int64_t ints[5] = {r->lane->starts[c], r->lane->sizes[c], r->part->n_regions,
                       area_base(r, c), r->part->unit};
    union { int32_t i32; int64_t i64; uint64_t ptr; } arg[8];
    uint64_t none = 0;
    void *params[16];
    arg[0].ptr = r->blocks;
    arg[1].ptr = r->blocks; /* slots: unused, the staging area is indexed by position */
    arg[2].ptr = (uint64_t)r->part->regions;
    for (int j = 0; j < 5; j++) {
        if (!(k->wide >> j & 1) && !fits32(ints[j]))
            return kvo_job_fail(job, p->d, 1, STEP_ARG, c, -1,
                                "a copy-kernel argument does not fit the compiled variant's i32");
        if (k->wide >> j & 1) arg[3 + j].i64 = ints[j];
        else arg[3 + j].i32 = (int32_t)ints[j];
    }
    for (int j = 0; j < 8; j++) params[j] = &arg[j];
    for (int j = 8; j < 16; j++) params[j] = &none;
    /* a store's first gather / a load's last scatter has no copy beside it (spec.h) */
    int64_t grid = k->grid;
    const kvo_spec *s = p->spec; /* a load's chunk: a program per so many bytes (spec.h) */
    int64_t per = job->dir == KVO_LOAD ? r->group->load_program_bytes : 0;
    int64_t want = per > 0 ? (r->lane->sizes[c] * r->part->unit + per - 1) / per : 0;
    if (want > s->max_grid) want = s->max_grid;
    if (want > grid) grid = want;
    int edge = job->dir == KVO_STORE ? c == 0 : c == r->n_chunks - 1;
    if (r->exposed && edge && s->exposed_grid > grid) grid = s->exposed_grid;
    int err = p->d->launch((void *)k->function, (unsigned)grid, 1, 1, (unsigned)k->block, 1, 1,
                          (unsigned)k->shared, stream, params, NULL);
    return err ? kvo_job_fail(job, p->d, err, STEP_LAUNCH, c, -1, NULL) : 0;
}

static int launch(part_run *r, int64_t c) {
    return launch_on(r, c, (kvo_stream)r->p->spec->gather[r->job->dir]);
}

/* Coupled loads (spec->load_coupled): chunk c is copied into its staging area and scattered from
 * it on one DMA stream, the area's own (area % n_dmas): no event between them, the area's next
 * use (the same stream; depth a multiple of n_dmas) ordered by the stream. Per chunk: its copies
 * and one launch (split adds four event calls); the copy engine holds at most n_dmas chunks. A
 * slice's words go on its last chunk's stream once the others joined it (the last's: finish).
 * A chunk's area is spec->load_span consecutive areas (by default a DMA stream's whole share):
 * a slice that fits is one chunk on one stream, so nothing joins it (a record and a wait saved
 * per slice, and a launch and its copies per chunk no longer cut). */
static kvo_stream area_stream(const part_run *r, int64_t c) {
    const kvo_spec *s = r->p->spec;
    return (kvo_stream)s->dmas[r->job->dir][area_of(r, c) % s->n_dmas];
}

/* Before a DMA stream's first kernel of the job (coupled chunks): the caller's work (a scatter
 * overwrites blocks the engine may read; a gather reads blocks it writes) and the ids' upload. */
static int order_once(part_run *r, int64_t c, kvo_stream st, int j) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    kvo_lane *lane = r->lane;
    if (!(lane->unordered >> j & 1u)) return 0;
    if (job->order != NULL) TRY(p->d->wait(st, job->order, 0), STEP_WAIT, c);
    if (job->total > p->spec->host_ids) TRY(p->d->wait(st, lane->joins[0], 0), STEP_WAIT, c);
    lane->unordered &= ~(1u << j);
    return 0;
}

static int coupled_chunk(part_run *r, int64_t c) {
    const kvo_pipe *p = r->p;
    kvo_lane *lane = r->lane;
    kvo_stream st = area_stream(r, c);
    int j = (int)(area_of(r, c) % p->spec->n_dmas);
    int err = kvo_part_copies(r, c, st);
    if (!err) err = order_once(r, c, st, j);
    if (!err) err = launch_on(r, c, st);
    if (!err) {
        lane->slice_streams |= 1u << j;
        lane->job_streams |= 1u << j;
        lane->job_last = j;
    }
    return err;
}

/* A store's chunk: once its area is free, gather into it, mark it filled. */
static int gather(part_run *r, int64_t c) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    kvo_stream g = (kvo_stream)p->spec->gather[job->dir];
    int64_t area = area_of(r, c);
    TRY(p->d->wait(g, r->lane->freed[area], 0), STEP_WAIT, c);
    int err = launch(r, c);
    if (err) return err;
    TRY(p->d->record(r->lane->filled[area], g), STEP_RECORD, c);
    return 0;
}

/* A store's chunks go to the copy engine one at a time: with two or more DMA streams, a chunk's
 * copies wait (a cross-stream event wait) for the copies of the chunk before it (that area's
 * `freed` event). A copy engine serves its queue in order, so a copy the engine enqueues after
 * ours in the same direction (a step's sampled token, the first token's logits) waits behind
 * every chunk queued ahead of it. Measured on an H100 (bench e2e, Llama-3-8B, full graphs, docs):
 * the host's read of the first token took 30.5 ms unpaced (13 ms after the forward's 17.8) and
 * 26.4 ms paced (right after its forward); raw 32 MiB copies paced this way kept a 512 MiB
 * copy's time (10.6 ms) while a small copy behind them waited 1.5 ms instead of 10.6
 * (benchmarks/copy_queue_probe.py). Loads are not paced: paced the same way (a wait on the
 * chunk before's `filled`), the layers of a full-graph forward waited 7.7-8.3 ms for their
 * slices (0.15 ms unpaced), and a small host-to-device copy behind the paced load still waited
 * for all of it (11.4 ms); an engine uploads its inputs before it starts a load (as vLLM's
 * runner does). With one DMA stream nothing is paced. */
static int pace_store(part_run *r, int64_t c, kvo_stream dma) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    if (p->spec->n_dmas < 2) return 0;
    TRY(p->d->wait(dma, r->lane->freed[area_of(r, c + r->depth - 1)], 0), STEP_WAIT, c);
    return 0;
}

/* A coupled store's pacing (pace_store's, with fewer driver calls): a chunk after the job's
 * first waits for the chunk before's `freed`; the job's first chunk waits for the job before's
 * done word (written after its last copies, on the stream its end is on), and not at all where
 * the host reads that word reached already: a store after an idle spell (an engine's inline
 * stores of a few blocks per step) pays no wait, and its last chunk records no `freed` (nothing
 * of its own follows it). */
static int pace_coupled_store(part_run *r, int64_t c, kvo_stream st) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    if (p->spec->n_dmas < 2) return 0;
    if (!(r->ends & PART_FIRST) || c > 0) return pace_store(r, c, st);
    uint32_t prev = r->lane->prev_seq;
    if (prev == 0 || kvo_flag_reached(p->flags, kvo_word_done(job->dir), prev)) return 0;
    kvo_ops ops;
    kvo_ops_begin(&ops, p->d, p->flags, st);
    kvo_ops_wait(&ops, kvo_word_done(job->dir), prev, KVO_WAIT_GEQ);
    int err = kvo_ops_end(&ops);
    return err ? kvo_job_fail(job, p->d, err, STEP_WAIT, c, -1, "the wait for the store before")
               : 0;
}

/* Coupled stores (spec->store_coupled): chunk c is gathered into its staging area and copied out
 * of it on one DMA stream, the area's own (no event between them; its next use is ordered by the
 * stream). Per chunk: one launch, its copies and the pacing (pace_coupled_store), three event
 * calls fewer than split (fake driver, Llama-3-8B stores of 1, 16, 256 blocks: 13, 34, 140 calls
 * split, 8, 23, 87 coupled before a job's end joined only the streams it used; a one-block store
 * after the one before it finished: 6 calls since 2026-11-28, was 8). */
static int coupled_store_chunk(part_run *r, int64_t c) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    kvo_stream st = area_stream(r, c);
    int j = (int)(area_of(r, c) % p->spec->n_dmas);
    int last = (r->ends & PART_LAST) && c == r->n_chunks - 1;
    int err = order_once(r, c, st, j);
    if (!err) err = launch_on(r, c, st);
    if (!err) err = pace_coupled_store(r, c, st);
    if (!err) err = kvo_part_copies(r, c, st);
    if (!err && p->spec->n_dmas > 1 && !last) /* the next chunk's copies wait for these */
        TRY(p->d->record(r->lane->freed[area_of(r, c)], st), STEP_RECORD, c);
    if (!err) r->lane->job_streams |= 1u << (r->lane->job_last = j);
    return err;
}

/* A load's chunk: once its area is free, DMA the slots into it, mark it filled. */
static int send(part_run *r, int64_t c) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    kvo_stream dma = (kvo_stream)p->spec->dmas[job->dir][c % p->spec->n_dmas];
    int64_t area = area_of(r, c);
    TRY(p->d->wait(dma, r->lane->freed[area], 0), STEP_WAIT, c);
    int err = kvo_part_copies(r, c, dma);
    if (err) return err;
    TRY(p->d->record(r->lane->filled[area], dma), STEP_RECORD, c);
    return 0;
}

/* Chunk sizes. A store's double from the first chunk's bytes up to one staging area (a short
 * exposed gather); a tail shorter than the first chunk joins the chunk before it where they fit
 * an area. A load's slice is cut into the fewest equal chunks that fit an area: a chunk costs the
 * caller a launch and event calls, and the slices' scatters already overlap the next slice's
 * copy (a 256-block Llama-3-8B load enqueued in 0.32 ms instead of 0.93, enqueue_probe.py). */
static int plan_chunks(const kvo_pipe *p, kvo_lane *lane, int64_t n, int64_t unit, int store,
                       int64_t span, int64_t *chunks) {
    int64_t largest = p->spec->area_bytes * span / unit, first = p->spec->first_chunk_bytes / unit;
    if (first < 1) first = 1;
    if (first > largest) first = largest;
    int64_t *arrays[2] = {lane->sizes, lane->starts};
    if (kvo_grow(arrays, &lane->scratch_chunks, n + 1, 2) != 0) return -1;
    lane->sizes = arrays[0];
    lane->starts = arrays[1];
    int64_t m = 0, left = n, size = first;
    if (!store) {
        int64_t parts = (n + largest - 1) / largest;
        for (int64_t i = 0; i < parts; i++) lane->sizes[m++] = n / parts + (i < n % parts);
        left = 0;
    }
    while (left > 0) {
        int64_t t = size < left ? size : left;
        if (left - t < first && left <= largest) t = left; /* 12+24+1 blocks -> 12+25 */
        lane->sizes[m++] = t;
        left -= t;
        size = size * 2 < largest ? size * 2 : largest;
    }
    for (int64_t i = 0, at = 0; i < m; i++) {
        lane->starts[i] = at;
        at += lane->sizes[i];
    }
    *chunks = m;
    return 0;
}

/* Every chunk of one spec's part: the chunk loop of the staged path. */
static int enqueue_part(const kvo_pipe *p, kvo_lane *lane, kvo_job *job, int64_t s,
                        const kvo_part *part, kvo_dptr blocks, int exposed, int ends) {
    int64_t n = job->count[s];
    if (n == 0) return 0;
    const kvo_group *g = &p->spec->groups[job->group[s]];
    int store = job->dir == KVO_STORE;
    int64_t span = store ? 1 : p->spec->load_span; /* 1 for split loads (spec.c) */
    int64_t depth = p->spec->depth / span, m = 0;
    if (plan_chunks(p, lane, n, part->unit, store, span, &m) != 0)
        return kvo_job_fail(job, p->d, 2, STEP_ALLOC, -1, -1, "out of host memory (chunk plan)");
    int64_t *desc[3] = {lane->src, lane->dst, lane->len};
    if (kvo_grow(desc, &lane->scratch_desc, n, 3) != 0)
        return kvo_job_fail(job, p->d, 2, STEP_ALLOC, -1, -1, "out of host memory (descriptors)");
    lane->src = desc[0];
    lane->dst = desc[1];
    lane->len = desc[2];
    part_run r = {p, job, lane, part, g, job->ids + job->at[s] + n, blocks,
                  m, depth, lane->position, 0, span,
                  part->offset == 0 && part->unit == p->spec->arena_slot_bytes, ends, exposed};
    lane->position = (lane->position + m) % depth;
    int64_t ahead = depth < m ? depth : m;
    int err;
    kvo_stream gs = (kvo_stream)p->spec->gather[job->dir];
    if (store && p->spec->store_coupled) {
        for (int64_t c = 0; c < m; c++)
            if ((err = coupled_store_chunk(&r, c))) return err;
    } else if (store) {
        for (int64_t c = 0; c < ahead; c++)
            if ((err = gather(&r, c))) return err;
        for (int64_t c = 0; c < m; c++) {
            int64_t area = area_of(&r, c);
            kvo_stream dma = (kvo_stream)p->spec->dmas[KVO_STORE][c % p->spec->n_dmas];
            if ((err = pace_store(&r, c, dma))) return err;
            TRY(p->d->wait(dma, lane->filled[area], 0), STEP_WAIT, c);
            if ((err = kvo_part_copies(&r, c, dma))) return err;
            TRY(p->d->record(lane->freed[area], dma), STEP_RECORD, c);
            if (c + ahead < m && (err = gather(&r, c + ahead))) return err;
        }
    } else if (p->spec->load_coupled) {
        for (int64_t c = 0; c < m; c++)
            if ((err = coupled_chunk(&r, c))) return err;
    } else {
        for (int64_t c = 0; c < ahead; c++)
            if ((err = send(&r, c))) return err;
        for (int64_t c = 0; c < m; c++) {
            int64_t area = area_of(&r, c);
            TRY(p->d->wait(gs, lane->filled[area], 0), STEP_WAIT, c);
            if ((err = launch(&r, c))) return err;
            TRY(p->d->record(lane->freed[area], gs), STEP_RECORD, c);
            if (c + ahead < m && (err = send(&r, c + ahead))) return err;
        }
    }
    lane->parts++;
    return 0;
}

/* Slice k's layers are in place: their flag words take the job's sequence number; once this is
 * enqueued, job->marked says so (waits.c: a wait on those layers needs no more of the job). */
static int mark_slice(const kvo_pipe *p, kvo_lane *lane, kvo_job *job, int64_t k) {
    kvo_stream on = (kvo_stream)p->spec->gather[KVO_LOAD];
    if (p->spec->load_coupled) { /* on the slice's last stream, the others joined to it */
        on = (kvo_stream)p->spec->dmas[KVO_LOAD][lane->job_last];
        for (int j = 0; j < (int)p->spec->n_dmas; j++) {
            if (j == lane->job_last || !(lane->slice_streams >> j & 1u)) continue;
            kvo_stream other = (kvo_stream)p->spec->dmas[KVO_LOAD][j];
            int err = p->d->record(lane->joins[1 + j], other);
            if (!err) err = p->d->wait(on, lane->joins[1 + j], 0);
            if (err) return kvo_job_fail(job, p->d, err, STEP_WAIT, -1, -1, "a slice's join");
        }
        lane->slice_streams = 0;
    }
    kvo_ops ops;
    kvo_ops_begin(&ops, p->d, p->flags, on);
    for (int64_t l = 0; l < job->n_layers; l++)
        if (job->layer_slice[l] == k) kvo_ops_write(&ops, kvo_word_layer(p->flags, l), job->seq);
    int err = kvo_ops_end(&ops);
    if (!err) __atomic_store_n(&job->marked, k + 1, __ATOMIC_RELEASE);
    return err ? kvo_job_fail(job, p->d, err, STEP_FLAG, -1, -1, "a layer slice's flag") : 0;
}

static int run_parts(const kvo_pipe *p, kvo_lane *lane, kvo_job *job, kvo_dptr ids) {
    int err;
    if (job->dir == KVO_STORE) {
        kvo_dptr at = ids;
        int64_t first = 0, last = job->n_specs - 1; /* the first and last specs with blocks */
        while (first < last && job->count[first] == 0) first++;
        while (last > first && job->count[last] == 0) last--;
        for (int64_t s = 0; s < job->n_specs; s++) {
            const kvo_group *g = &p->spec->groups[job->group[s]];
            int ends = (s == first ? PART_FIRST : 0) | (s == last ? PART_LAST : 0);
            if ((err = enqueue_part(p, lane, job, s, &g->parts[0], at, s == 0, ends))) return err;
            at += (kvo_dptr)job->count[s] * 8;
        }
        return 0;
    }
    for (int64_t k = 0; k < job->n_slices; k++) {
        kvo_dptr at = ids;
        for (int64_t s = 0; s < job->n_specs; s++) {
            const kvo_group *g = &p->spec->groups[job->group[s]];
            if (k < job->plan_count[s] &&
                (err = enqueue_part(p, lane, job, s, &g->parts[job->plan_first[s] + k], at,
                                    k == job->n_slices - 1, 0)))
                return err;
            at += (kvo_dptr)job->count[s] * 8;
        }
        if (k + 1 < job->n_slices && (err = mark_slice(p, lane, job, k))) return err;
    }
    return 0;
}

/* The streams of a direction: the kernels' first, then its DMA streams. */
static int n_streams(const kvo_pipe *p) { return 1 + (int)p->spec->n_dmas; }
static kvo_stream stream_of(const kvo_pipe *p, int dir, int j) {
    return (kvo_stream)(j == 0 ? p->spec->gather[dir] : p->spec->dmas[dir][j - 1]);
}

/* The job's end on its tail: a coupled job's last chunk's stream, else (or after a failure) a
 * store's first DMA stream or a load's kernels' stream. The other streams the job used join it
 * (all after a failure), one call writes the flag words (a load's last slice's, the done word),
 * the tail is kept for the core's query of a job in flight long (core.c, check); else the host
 * waits for the streams and writes the words. */
static int is_coupled(const kvo_pipe *p, int dir) {
    return dir == KVO_LOAD ? p->spec->load_coupled != 0 : p->spec->store_coupled != 0;
}

static int finish(const kvo_pipe *p, kvo_lane *lane, kvo_job *job) {
    int dir = job->dir, coupled = is_coupled(p, dir);
    int tail_j = dir == KVO_STORE ? 1 : 0;
    if (coupled && !job->failed && lane->job_streams) tail_j = 1 + lane->job_last;
    kvo_stream tail = stream_of(p, dir, tail_j);
    int err = 0;
    for (int j = 0; j < n_streams(p) && !err; j++) {
        int used = j >= 1 && (lane->job_streams >> (j - 1) & 1u);
        int joins = job->failed || (coupled ? used : dir == KVO_STORE && j > 1);
        if (j == tail_j || !joins) continue;
        err = p->d->record(lane->joins[j], stream_of(p, dir, j));
        if (!err) err = p->d->wait(tail, lane->joins[j], 0);
    }
    kvo_ops ops;
    kvo_ops_begin(&ops, p->d, p->flags, tail);
    for (int64_t l = 0; l < job->n_layers; l++) /* the last slice's, or all after a failure */
        if (job->failed || job->layer_slice[l] == job->n_slices - 1)
            kvo_ops_write(&ops, kvo_word_layer(p->flags, l), job->seq);
    kvo_ops_write(&ops, kvo_word_done(dir), job->seq);
    if (!err) err = kvo_ops_end(&ops);
    if (!err) {
        job->tail = tail; /* the core queries it for a device error (core.c, check) */
        return 0;
    }
    kvo_job_fail(job, p->d, err, STEP_FLAG, -1, -1, "the transfer's end (flags set on the host)");
    for (int j = 0; j < n_streams(p); j++) p->d->stream_sync(stream_of(p, dir, j));
    for (int64_t l = 0; l < job->n_layers; l++)
        kvo_flag_set(p->flags, kvo_word_layer(p->flags, l), job->seq);
    kvo_flag_set(p->flags, kvo_word_done(dir), job->seq);
    return err;
}

int kvo_pipeline_run(const kvo_pipe *p, kvo_lane *lane, kvo_job *job) {
    lane->prev_seq = lane->seq;
    job->seq = ++lane->seq;
    if (job->seq == 0) job->seq = ++lane->seq; /* 0 is "never used" (index buffers) */
    int err = 0;
    kvo_dptr ids = 0;
    int coupled = is_coupled(p, job->dir);
    /* only the kernels touch the engine's memory: their stream waits for the caller's work; the
     * DMA streams follow the kernels (coupled chunks: each DMA stream waits before its first
     * kernel, order_once) */
    if (job->order != NULL && !coupled) {
        err = p->d->wait(stream_of(p, job->dir, 0), job->order, 0);
        if (err) kvo_job_fail(job, p->d, err, STEP_WAIT, -1, -1, "the wait for the caller's stream");
    }
    lane->slice_streams = lane->job_streams = 0;
    lane->unordered = coupled ? (1u << p->spec->n_dmas) - 1 : 0;
    if (!err) err = kvo_upload_ids(p, lane, job, &ids);
    if (!err && coupled && job->total > p->spec->host_ids) { /* up on the kernels' stream: marked */
        err = p->d->record(lane->joins[0], stream_of(p, job->dir, 0));
        if (err) kvo_job_fail(job, p->d, err, STEP_RECORD, -1, -1, "the block ids' upload");
    }
    if (!err) err = run_parts(p, lane, job, ids);
    int end = finish(p, lane, job);
    return err ? err : end;
}
