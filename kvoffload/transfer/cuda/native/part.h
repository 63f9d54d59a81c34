/* One part of a job on its way through the staged pipeline (pipeline.c's chunk loop), shared
 * with copies.c, which enqueues a chunk's copy-engine descriptors. */
#ifndef KVO_PART_H
#define KVO_PART_H

#include "pipeline.h"

typedef struct {
    const kvo_pipe *p;
    kvo_job *job;
    kvo_lane *lane;
    const kvo_part *part;
    const kvo_group *group; /* its kernel and load program bytes */
    const int64_t *slots;
    kvo_dptr blocks;
    int64_t n_chunks, depth, position, descs_before;
    int64_t span; /* areas per chunk (spec->load_span for coupled loads, else 1); depth counts
                   * chunks of span areas */
    int whole; /* whole host slots move: consecutive slots merge into one descriptor */
    int ends;  /* a store's part: PART_FIRST / PART_LAST, the first / last part with blocks */
    int exposed; /* a store's first part / a load's last slice: launch_on widens its edge */
} part_run;

#define PART_FIRST 1 /* its first chunk starts the job */
#define PART_LAST 2  /* its last chunk ends the job */

static inline int64_t area_of(const part_run *r, int64_t c) {
    return (r->position + c) % r->depth;
}

/* Chunk c's staging address: its first area's (the span's areas are consecutive in memory). */
static inline int64_t area_base(const part_run *r, int64_t c) {
    return r->p->spec->bases[r->job->dir][area_of(r, c) * r->span];
}

/* Grow `count` arrays of *cap int64s each to at least `need`; 0 or -1 (out of memory). */
int kvo_grow(int64_t **p, int64_t *cap, int64_t need, int count);
/* Chunk c's copies between its host slots and its staging area, on `stream`: consecutive whole
 * slots merged, pitched runs as one 2D copy, the rest one batch; 0 or the job's failure. */
int kvo_part_copies(part_run *r, int64_t c, kvo_stream stream);

#endif
