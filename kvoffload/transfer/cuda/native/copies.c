/* A chunk's copy-engine descriptors (part.h): whole host slots merged where consecutive, a
 * pitched run of a layer slice as one 2D copy, the rest one cuMemcpyBatchAsync (or one
 * cuMemcpyAsync where there is one copy, or no batch entry point). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "part.h"

/* CUmemcpyAttributes: source read in stream order (a store's DMA waits for its gather so). */
static struct { int order; int src_type, src_id, dst_type, dst_id; unsigned flags; } attrs = {1, 0, 0, 0, 0, 0};
static size_t attr_index[1] = {0};

int kvo_grow(int64_t **p, int64_t *cap, int64_t need, int count) {
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

/* CUDA_MEMCPY2D: one pitched copy (a run of consecutive host slots' slices into staging). */
typedef struct {
    size_t src_x, src_y;
    int src_type, pad0;
    const void *src_host;
    uint64_t src_dev;
    void *src_array;
    size_t src_pitch;
    size_t dst_x, dst_y;
    int dst_type, pad1;
    void *dst_host;
    uint64_t dst_dev;
    void *dst_array;
    size_t dst_pitch;
    size_t width, height;
} memcpy2d;

#define MEMORY_UNIFIED 4 /* CU_MEMORYTYPE_UNIFIED: an address of either side (UVA) */
#define RUN_2D 2         /* runs of at least this many consecutive slots go as one 2D copy */

/* Consecutive slots of a part that is not the whole slot (a load's layer slice) are a pitched
 * run in host memory: one 2D copy moves the run (measured: ~0.9 us of host time per
 * cuMemcpyBatchAsync descriptor, so a 1,000-block load of 16 slices took 15 ms to enqueue). */
static int run_2d(part_run *r, int64_t c, int64_t host, int64_t staged, int64_t rows,
                  kvo_stream stream) {
    const kvo_pipe *p = r->p;
    int64_t unit = r->part->unit;
    int store = r->job->dir == KVO_STORE;
    memcpy2d m;
    memset(&m, 0, sizeof m);
    m.src_type = m.dst_type = MEMORY_UNIFIED;
    m.src_dev = (uint64_t)(store ? staged : host);
    m.src_pitch = (size_t)(store ? unit : p->spec->arena_slot_bytes);
    m.dst_dev = (uint64_t)(store ? host : staged);
    m.dst_pitch = (size_t)(store ? p->spec->arena_slot_bytes : unit);
    m.width = (size_t)unit;
    m.height = (size_t)rows;
    int err = p->d->copy2d(&m, stream);
    return err ? kvo_job_fail(r->job, p->d, err, STEP_COPY, c, r->descs_before, NULL) : 0;
}

int kvo_part_copies(part_run *r, int64_t c, kvo_stream stream) {
    const kvo_pipe *p = r->p;
    kvo_job *job = r->job;
    kvo_lane *lane = r->lane;
    const kvo_spec *s = p->spec;
    int64_t start = lane->starts[c], count = lane->sizes[c], unit = r->part->unit;
    int64_t base = area_base(r, c), n = 0;
    int store = job->dir == KVO_STORE;
    for (int64_t i = 0; i < count; i++) {
        const int64_t *slots = r->slots + start;
        int64_t host = s->arena_base + slots[i] * s->arena_slot_bytes + r->part->offset;
        int64_t staged = base + i * unit;
        if (r->whole && n > 0 && slots[i] == slots[i - 1] + 1) {
            lane->len[n - 1] += unit;
            continue;
        }
        int64_t run = 1;
        while (!r->whole && i + run < count && slots[i + run] == slots[i] + run) run++;
        if (run >= RUN_2D) {
            int err = run_2d(r, c, host, staged, run, stream);
            if (err) return err;
            r->descs_before++;
            i += run - 1;
            continue;
        }
        lane->src[n] = store ? staged : host;
        lane->dst[n] = store ? host : staged;
        lane->len[n] = unit;
        n++;
    }
    if (n == 0) return 0;
    if (p->d->batch == NULL || n == 1) { /* one copy: cuMemcpyAsync costs a third of a batch */
        for (int64_t i = 0; i < n; i++) {
            int err = p->d->copy((kvo_dptr)lane->dst[i], (kvo_dptr)lane->src[i],
                                (size_t)lane->len[i], stream);
            if (err)
                return kvo_job_fail(job, p->d, err, STEP_COPY, c, r->descs_before + i, NULL);
        }
    } else {
        size_t fail = SIZE_MAX;
        int err = p->d->batch(lane->dst, lane->src, lane->len, (size_t)n, &attrs, attr_index, 1,
                             &fail, stream);
        if (err)
            return kvo_job_fail(job, p->d, err, STEP_COPY, c,
                            fail < (size_t)n ? r->descs_before + (int64_t)fail : -1, NULL);
    }
    r->descs_before += n;
    return 0;
}

