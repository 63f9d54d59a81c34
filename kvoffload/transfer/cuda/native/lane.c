/* A direction's lane (pipeline.h): its staging ring's events, its index buffers of block ids
 * (uploaded per job, reused once the job that last used one is done), its scratch. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pipeline.h"

#define TRY(call, step, chunk)                                                      \
    do {                                                                            \
        int err_ = (call);                                                          \
        if (err_) return kvo_job_fail(job, p->d, err_, (step), (chunk), -1, NULL);  \
    } while (0)

/* Wait (bounded) until the GPU is done with index buffer k's last job. */
static int index_free(const kvo_pipe *p, kvo_lane *lane, kvo_job *job, int64_t k) {
    if (lane->index[k].seq == 0) return 0;
    double until = kvo_now() + KVO_REUSE_WAIT_S;
    while (!kvo_flag_reached(p->flags, kvo_word_done(job->dir), lane->index[k].seq)) {
        if (kvo_now() > until)
            return kvo_job_fail(job, p->d, 1, STEP_WAIT, -1, -1,
                                "an index buffer's previous transfer did not finish in time");
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* A buffer of this job's block ids for the kernels: pinned host memory for a few ids (no copy
 * to wait for), else a device buffer filled from its pinned twin by one copy on the kernels'
 * stream. Ring of KVO_INDEX_RING per direction; a buffer is reused once its last job is done. */
int kvo_upload_ids(const kvo_pipe *p, kvo_lane *lane, kvo_job *job, kvo_dptr *dev) {
    int64_t k = lane->index_pos++ % KVO_INDEX_RING;
    int err = index_free(p, lane, job, k);
    if (err) return err;
    int64_t need = job->total > 0 ? job->total : 1;
    if (lane->index[k].capacity < need) {
        int64_t cap = lane->index[k].capacity * 2;
        if (cap < 2 * need) cap = 2 * need;
        if (lane->index[k].host != NULL) p->d->host_free(lane->index[k].host);
        if (lane->index[k].dev != 0) p->d->mem_free(lane->index[k].dev);
        lane->index[k].host = NULL;
        lane->index[k].dev = 0;
        lane->index[k].capacity = 0;
        TRY(p->d->host_alloc(&lane->index[k].host, (size_t)cap * 8, 0), STEP_ALLOC, -1);
        TRY(p->d->mem_alloc(&lane->index[k].dev, (size_t)cap * 8), STEP_ALLOC, -1);
        lane->index[k].capacity = cap;
    }
    lane->index[k].seq = job->seq;
    int64_t *host = lane->index[k].host;
    int64_t at = 0;
    for (int64_t s = 0; s < job->n_specs; s++) {
        memcpy(host + at, job->ids + job->at[s], (size_t)job->count[s] * 8);
        at += job->count[s];
    }
    if (at <= p->spec->host_ids) {
        *dev = (kvo_dptr)(uintptr_t)host;
        return 0;
    }
    *dev = lane->index[k].dev;
    TRY(p->d->copy(*dev, (kvo_dptr)(uintptr_t)host, (size_t)at * 8,
                   (kvo_stream)p->spec->gather[job->dir]),
        STEP_COPY, -1);
    return 0;
}

int kvo_lane_init(kvo_lane *lane, const kvo_pipe *p, int dir) {
    memset(lane, 0, sizeof *lane);
    for (int64_t a = 0; a < p->spec->depth; a++) {
        int err = p->d->event_create(&lane->filled[a], 2 /* CU_EVENT_DISABLE_TIMING */);
        if (!err) err = p->d->event_create(&lane->freed[a], 2);
        if (err) return err;
    }
    for (int j = 0; j < 1 + (int)p->spec->n_dmas; j++) { /* the kernels' stream and the DMA streams */
        int err = p->d->event_create(&lane->joins[j], 2);
        if (err) return err;
    }
    for (int k = 0; k < KVO_INDEX_RING; k++) { /* allocated now: pinning memory takes
                                                  * milliseconds, which no transfer should wait */
        int err = p->d->host_alloc(&lane->index[k].host, KVO_INDEX_FIRST * 8, 0);
        if (!err) err = p->d->mem_alloc(&lane->index[k].dev, KVO_INDEX_FIRST * 8);
        if (err) return err;
        lane->index[k].capacity = KVO_INDEX_FIRST;
    }
    return 0;
}

void kvo_lane_free(kvo_lane *lane, const kvo_pipe *p) {
    for (int64_t a = 0; a < KVO_MAX_DEPTH; a++) {
        if (lane->filled[a]) p->d->event_destroy(lane->filled[a]);
        if (lane->freed[a]) p->d->event_destroy(lane->freed[a]);
    }
    for (int j = 0; j < KVO_MAX_DMAS + 1; j++)
        if (lane->joins[j]) p->d->event_destroy(lane->joins[j]);
    for (int k = 0; k < KVO_INDEX_RING; k++) {
        if (lane->index[k].host) p->d->host_free(lane->index[k].host);
        if (lane->index[k].dev) p->d->mem_free(lane->index[k].dev);
    }
    free(lane->sizes);
    free(lane->starts);
    free(lane->src);
    free(lane->dst);
    free(lane->len);
    memset(lane, 0, sizeof *lane);
}
