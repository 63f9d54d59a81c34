/* The core's CUDA events (core_state.h): a pool of free ones, taken at submit for a job (its
 * order and done events, a load's slice events) and given back when the job is dropped, i.e.
 * when nothing refers to it any more (the Python Job object, a bound waiter, the core's lists).
 * mu held throughout. */
#include <stdlib.h>

#include "core_state.h"

#define EVENT_POOL_MAX 4096 /* free events kept for reuse */
#define EVENT_NO_TIMING 2   /* CU_EVENT_DISABLE_TIMING */

static kvo_event event_take(kvo_core *e, int *err) {
    kvo_event ev = NULL;
    if (e->pool_n > 0) return e->pool[--e->pool_n];
    *err = e->d.event_create(&ev, EVENT_NO_TIMING);
    return ev;
}

static void event_give(kvo_core *e, kvo_event ev) {
    if (ev == NULL) return;
    if (e->closing || (e->pool_n == e->pool_cap && e->pool_cap >= EVENT_POOL_MAX)) {
        e->d.event_destroy(ev);
        return;
    }
    if (e->pool_n == e->pool_cap) {
        int64_t cap = e->pool_cap ? 2 * e->pool_cap : 64;
        kvo_event *p = realloc(e->pool, (size_t)cap * sizeof *p);
        if (p == NULL) {
            e->d.event_destroy(ev);
            return;
        }
        e->pool = p;
        e->pool_cap = cap;
    }
    e->pool[e->pool_n++] = ev;
}

void kvo_job_drop(kvo_core *e, kvo_job *job) {
    event_give(e, job->order);
    event_give(e, job->done_ev);
    for (int64_t k = 0; job->slice_ev != NULL && k < job->n_slices; k++)
        event_give(e, job->slice_ev[k]);
    kvo_job_free(job);
}

void kvo_unref(kvo_core *e, kvo_job *job) {
    if (--job->refs == 0) kvo_job_drop(e, job);
}

void kvo_job_release(kvo_core *e, kvo_job *job) {
    pthread_mutex_lock(&e->mu);
    kvo_unref(e, job);
    pthread_mutex_unlock(&e->mu);
}

/* A load's slice events: an engine stream's layer wait is a cuStreamWaitEvent on its slice's
 * (waits.c). They go back to the pool with the job, once nothing (a bound waiter) refers to it,
 * so a wait never names a record of another job's. Without them (no memory, no events) its
 * waits are flag waits. */
static void take_slice_events(kvo_core *e, kvo_job *job) { /* mu held */
    if (job->dir != KVO_LOAD || job->n_slices < 1) return;
    job->slice_ev = calloc((size_t)job->n_slices, sizeof *job->slice_ev);
    int err = 0;
    for (int64_t k = 0; job->slice_ev != NULL && k < job->n_slices && !err; k++)
        job->slice_ev[k] = event_take(e, &err);
    if (!err || job->slice_ev == NULL) return;
    for (int64_t k = 0; k < job->n_slices; k++) event_give(e, job->slice_ev[k]);
    free(job->slice_ev);
    job->slice_ev = NULL;
}

int kvo_take_events(kvo_core *e, kvo_job *job, int has_order) { /* mu held */
    int err = 0;
    job->done_ev = event_take(e, &err);
    if (!err && has_order) job->order = event_take(e, &err);
    if (!err) take_slice_events(e, job);
    return err;
}

