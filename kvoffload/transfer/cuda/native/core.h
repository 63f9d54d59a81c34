/* The native transfer core's API: what the binding (module.c) calls. The core's state,
 * lock and threads are private to core.c and waits.c. Every entry point returns a kvo_status
 * (kvo.h); messages go into a caller-owned buffer of KVO_MSG bytes; none of them needs the GIL,
 * and none may be called holding it where it can block (the binding releases it). */
#ifndef KVO_CORE_H
#define KVO_CORE_H

#include "job.h"

typedef struct kvo_core kvo_core;
typedef struct kvo_timer kvo_timer; /* stall.c */

typedef struct {
    int64_t submitted, completed, failed, parts, queued, in_flight;
    int64_t reaped; /* of `completed`: finished by a done() or wait() that read the done word */
    int closed, batch_copies;
} kvo_stats;

/* What a job reports (copied under the core's lock). */
typedef struct {
    int64_t id, slices, layers;
    int dir, settled; /* settled: enqueued (or never to be): the failure fields are final */
    int failed, cancelled, code, step;
    int64_t chunk, desc;
    double t_submit, t_start, t_enqueued, t_done;
    char message[KVO_MSG];
} kvo_job_info;

/* core.c */
kvo_status kvo_core_open(const kvo_driver *d, const int64_t *spec, int64_t n, kvo_core **out,
                           char *msg);
/* Validate every spec (a refusal changes nothing), then enqueue a store job and/or a load job:
 * here, where its direction is idle, it is at most inline_bytes and `background` is 0, else by
 * the direction's worker thread. out[0..*n_out): the jobs, each holding a reference the caller
 * releases. */
kvo_status kvo_core_submit(kvo_core *e, const kvo_input *in, int64_t n_in, kvo_stream order,
                             int has_order, int background, kvo_job **out, int *n_out,
                             char *msg);
/* Ids of the jobs finished since the last call (tracking starts at the first call); *ids is
 * malloc'd, the caller frees it. */
kvo_status kvo_core_finished(kvo_core *e, int64_t **ids, int64_t *n);
kvo_status kvo_core_stats(kvo_core *e, kvo_stats *out);
/* Cancel what has not started, wait for what is in flight, stop the threads (idempotent). */
void kvo_core_close(kvo_core *e);
void kvo_core_free(kvo_core *e); /* closes first */
void kvo_job_release(kvo_core *e, kvo_job *job);

/* waits.c */
kvo_status kvo_job_done(kvo_core *e, kvo_job *job, int *done);
kvo_status kvo_job_wait(kvo_core *e, kvo_job *job, double timeout, int *finished);
kvo_status kvo_job_cancel(kvo_core *e, kvo_job *job, int *cancelled);
/* Make `stream` wait on the GPU for the job (or for `layer` of a load): one stream memory
 * operation, enqueued at once; the host waits only where the job is still queued behind another
 * or being enqueued by a worker thread, a load's layer wait only until that layer's slice is
 * enqueued (bounded by timeout: KVO_TIMEOUT). *ok: 0 when the job failed or never ran (the engine
 * recomputes: the stream does not wait for it). With a timer (NULL: none), a wait it enqueues
 * for a layer the timer has is timed: the timer's events for that layer are recorded on
 * `stream` around it (kvo_timer_read). */
kvo_status kvo_job_wait_on(kvo_core *e, kvo_job *job, kvo_stream stream, int64_t layer,
                           double timeout, kvo_timer *timer, int *ok, char *msg);
/* 1 where kvo_job_wait_on would do nothing but set *ok (landed, cancelled, closed): no blocking,
 * no driver call, so a caller may skip releasing its locks (the binding: the GIL). */
int kvo_job_landed(kvo_core *e, kvo_job *job, int64_t layer, int *ok);
kvo_status kvo_job_describe(kvo_core *e, kvo_job *job, kvo_job_info *out);
/* Per layer, the load slice holding it (at most cap values; *n of them). */
kvo_status kvo_job_layer_slices(kvo_core *e, kvo_job *job, int64_t *out, int64_t cap, int64_t *n);

/* Layer gates: per layer a flag word (device memory) that a CUDA graph can wait on at fixed
 * addresses. gate_wait enqueues (capturable) "wait until open"; gate_open, once per step before
 * the replay, closes every layer on the caller's stream (one call, after the replays enqueued
 * there so far), then opens each on the core's gate stream once every listed job has landed it
 * (its streams wait on the GPU; the host waits only for jobs still queued, bounded by timeout).
 * Until 2026-11-27 each captured wait also closed its layer as the replay passed it, on a word in
 * host memory: +11.0 us a layer beside a copy against +4.6 now (gate_graph_probe, H200). */
kvo_status kvo_gate_create(kvo_core *e, int64_t layers, int64_t *gate, char *msg);
kvo_status kvo_gate_wait(kvo_core *e, int64_t gate, kvo_stream stream, int64_t layer, char *msg);
kvo_status kvo_gate_open(kvo_core *e, int64_t gate, kvo_stream stream, kvo_job *const *jobs,
                         int64_t n, double timeout, char *msg);

/* stall.c: stall timers. Per layer two timing events that the waits record on the engine's
 * stream around a wait they enqueue, so the engine can read how long its stream stood at each
 * layer's wait (two driver calls per timed wait, in the waiting thread). One thread uses a
 * timer at a time. */
kvo_status kvo_timer_create(kvo_core *e, int64_t layers, kvo_timer **out, char *msg);
void kvo_timer_free(kvo_core *e, kvo_timer *t);
void kvo_timer_reset(kvo_timer *t); /* every layer untimed again (its events are reused) */
int64_t kvo_timer_layers(const kvo_timer *t);
/* host seconds the timer's own event records took since its last reset (an instrument's cost,
 * inside the waits that made them) */
double kvo_timer_own_s(const kvo_timer *t);
/* Per layer: seconds the stream stood at its timed wait; 0 where no wait was timed; -1 where
 * the stream has not passed it yet. KVO_FAILED where the driver cannot tell (msg says why). */
kvo_status kvo_timer_read(kvo_core *e, kvo_timer *t, double *out, char *msg);
/* For kvo_job_wait_on, in our context: begin records `layer`'s start event on `stream` (1 if it
 * did; 0: the layer stays untimed); end, once the wait is enqueued (ok) or refused, records its
 * end event and marks the layer timed (a first wait's start stays where several jobs' waits
 * meet at one layer, its end moves to the last). */
int kvo_timer_begin(kvo_core *e, kvo_timer *t, int64_t layer, kvo_stream stream);
void kvo_timer_end(kvo_core *e, kvo_timer *t, int64_t layer, kvo_stream stream, int ok);

#endif
