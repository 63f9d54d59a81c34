/* The core's state: private to its two halves, core.c (lifecycle, submit, threads) and
 * waits.c (waits, gates, reports). Locking: one mutex (mu) for queues, job states, the event
 * pool and the gates; `changed` is broadcast on every state change (waiters re-check). A thread
 * never calls into Python holding mu, and the binding releases the GIL before any call here. */
#ifndef KVO_CORE_STATE_H
#define KVO_CORE_STATE_H

#include <pthread.h>

#include "core.h"
#include "pipeline.h"

struct kvo_core {
    kvo_driver d;
    kvo_spec spec;
    kvo_flags flags;
    kvo_pipe pipe;
    kvo_lane lane[2];
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t work[2], changed;
    kvo_job *queue_head[2], *queue_tail[2];
    kvo_job *inflight;  /* enqueued, not finished */
    int running[2];     /* a thread is enqueueing a job of this direction */
    int closing, closed, threads_started, workers_exited;
    int flag_users; /* waits and gates reading the flag words now (close frees them after) */
    pthread_t worker[2], completer;
    kvo_event *pool; /* free events */
    int64_t pool_n, pool_cap;
    pthread_mutex_t check_mu; /* the duplicate-check bitmaps */
    uint8_t *seen_slots, *seen_blocks;
    int64_t next_id;
    int64_t *finished; /* ids finished since the last drain (when tracking) */
    int64_t finished_n, finished_cap;
    int track_finished;
    int64_t submitted, completed, failures, reaped;
    int64_t gates, gate_layers[KVO_MAX_GATES];
    kvo_event gate_event[KVO_MAX_GATES];
};

void *kvo_ctx_enter(kvo_core *e);
void kvo_ctx_leave(kvo_core *e, void *prev);
void kvo_unref(kvo_core *e, kvo_job *job); /* mu held */
/* mu held: sleep on `changed` until deadline (absolute kvo_now() seconds; <= 0: no limit). */
int kvo_timed_wait(kvo_core *e, double deadline);
void kvo_finish(kvo_core *e, kvo_job *job); /* mu held; drops the core's reference */
void kvo_end_locked(kvo_core *e, kvo_job *job); /* mu held: out of `inflight`, kvo_finish */

#endif
