/* The core's waits and reports (core.h): a job's end on the host, a job's layers on the GPU
 * (wait_on, one stream memory operation), layer gates for CUDA graphs, and what jobs report.
 *
 * No wait on the GPU can depend on work that is not enqueued yet: wait_on and gate_open first
 * wait (on the host, bounded) for a job still queued behind another to be enqueued, and a job's
 * enqueue writes every flag word it owns whatever fails (pipeline.h). So a thread blocked in the
 * driver (a lazy module load waits for the device to go idle while holding the context's lock)
 * never waits for a copy that could only be enqueued after it. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core_state.h"

/* A waiter reads the done word back to back for the spec's wait_spin_ns before it sleeps: a
 * condition-variable wake-up costs ~20 us (H100 VM) and a timed sleep overshoots by the kernel's
 * timer slack (50 us by default), more than a small transfer's remaining time. */
#define WAIT_PAUSE_MIN_S 10e-6
#define WAIT_PAUSE_MAX_S 20e-6


/* A reader of the flag words: 1 and counted while the core is open (close waits for the count
 * to drain before it frees them), else 0 (every job has ended: nothing to wait for). */
static int flags_enter(kvo_core *e) {
    __atomic_add_fetch(&e->flag_users, 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&e->closed, __ATOMIC_SEQ_CST)) return 1;
    __atomic_sub_fetch(&e->flag_users, 1, __ATOMIC_SEQ_CST);
    return 0;
}

static void flags_leave(kvo_core *e) { __atomic_sub_fetch(&e->flag_users, 1, __ATOMIC_SEQ_CST); }

static int state_of(kvo_job *job) { return __atomic_load_n(&job->state, __ATOMIC_ACQUIRE); }

void kvo_end_locked(kvo_core *e, kvo_job *job) {
    kvo_job **pp = &e->inflight;
    while (*pp != job) pp = &(*pp)->next;
    *pp = job->next;
    job->next = NULL;
    kvo_finish(e, job);
}

/* Whoever asks finishes a job whose done word the GPU wrote (the completion thread does the same
 * for jobs nobody asks about, slowly): 1 finished. A read of host memory, and the lock only for
 * the job that just ended; no driver call. */
static int reap(kvo_core *e, kvo_job *job) {
    int state = state_of(job);
    if (state != KVO_INFLIGHT) return state == KVO_DONE;
    if (!flags_enter(e)) return state_of(job) == KVO_DONE; /* closed: every job ended */
    int landed = kvo_flag_reached(&e->flags, kvo_word_done(job->dir), job->seq);
    flags_leave(e);
    if (!landed) return 0;
    pthread_mutex_lock(&e->mu);
    if (job->state == KVO_INFLIGHT) {
        e->reaped++;
        kvo_end_locked(e, job);
    }
    pthread_mutex_unlock(&e->mu);
    return 1;
}

kvo_status kvo_job_done(kvo_core *e, kvo_job *job, int *done) {
    *done = reap(e, job);
    return KVO_OK;
}

/* The waiter reads the done word itself: it spins wait_spin_ns, then sleeps ~1/16 of the job's age
 * between reads (WAIT_PAUSE_MIN_S..WAIT_PAUSE_MAX_S) on `changed`, which a cancel, a failure
 * the completion thread found, or the job's enqueue also wakes. */
kvo_status kvo_job_wait(kvo_core *e, kvo_job *job, double timeout, int *finished) {
    double start = kvo_now(), deadline = timeout < 0 ? 0 : start + timeout;
    double spin = (double)e->spec.wait_spin_ns * 1e-9;
    int done = reap(e, job);
    while (!done && timeout != 0) {
        double now = kvo_now();
        if (timeout > 0 && now >= deadline) break;
        if (now - start < spin) {
            CPU_RELAX();
        } else {
            double pause = (now - job->t_submit) / 16;
            pause = pause < WAIT_PAUSE_MIN_S ? WAIT_PAUSE_MIN_S
                    : pause > WAIT_PAUSE_MAX_S ? WAIT_PAUSE_MAX_S : pause;
            double until = timeout > 0 && now + pause > deadline ? deadline : now + pause;
            pthread_mutex_lock(&e->mu);
            if (job->state != KVO_DONE) kvo_timed_wait(e, until);
            pthread_mutex_unlock(&e->mu);
        }
        done = reap(e, job);
    }
    *finished = done;
    return KVO_OK;
}

kvo_status kvo_job_cancel(kvo_core *e, kvo_job *job, int *cancelled) {
    *cancelled = 0;
    pthread_mutex_lock(&e->mu);
    if (job->state == KVO_QUEUED) {
        kvo_job **pp = &e->queue_head[job->dir];
        kvo_job *prev = NULL;
        while (*pp != NULL && *pp != job) {
            prev = *pp;
            pp = &(*pp)->next;
        }
        if (*pp == job) {
            *pp = job->next;
            if (e->queue_tail[job->dir] == job) e->queue_tail[job->dir] = prev;
            job->next = NULL;
            job->cancelled = 1;
            kvo_job_fail(job, &e->d, 0, STEP_CANCEL, -1, -1, "cancelled before it started");
            kvo_finish(e, job);
            *cancelled = 1;
        }
    } else if (job->state == KVO_DONE && job->cancelled) {
        *cancelled = 1;
    }
    pthread_mutex_unlock(&e->mu);
    return KVO_OK;
}

/* Whether the job is enqueued (or will never be), or, for a load's slice >= 0, that slice's flag
 * writes are (pipeline.c, mark_slice): all a wait on that slice's layers depends on. */
static int enqueued(kvo_job *job, int64_t slice) {
    return state_of(job) >= KVO_INFLIGHT ||
           (slice >= 0 && __atomic_load_n(&job->marked, __ATOMIC_ACQUIRE) > slice);
}

/* Until enqueued(job, slice): at once unless the job is queued behind another or being enqueued
 * by another thread (a background submit). A slice's mark wakes nobody: its waiter reads it back
 * to back for the spec's wait_spin_ns (a slice is enqueued in tens of us), then every
 * WAIT_PAUSE_MIN_S. So no GPU-side wait is enqueued ahead of the work that satisfies it: a wait
 * ahead of it could also hold that work behind it, where their streams share one of the device's
 * hardware queues (round 19: the full-graph runs hung so). */
static kvo_status until_enqueued(kvo_core *e, kvo_job *job, int64_t slice, double timeout,
                                 char *msg) {
    if (enqueued(job, slice)) return KVO_OK;
    double start = kvo_now(), deadline = start + timeout;
    double spin = (double)e->spec.wait_spin_ns * 1e-9;
    while (slice >= 0 && !enqueued(job, slice) && kvo_now() - start < spin) CPU_RELAX();
    pthread_mutex_lock(&e->mu);
    for (double now = kvo_now(); !enqueued(job, slice) && now < deadline; now = kvo_now()) {
        double until = slice >= 0 && now + WAIT_PAUSE_MIN_S < deadline ? now + WAIT_PAUSE_MIN_S
                                                                       : deadline;
        kvo_timed_wait(e, until);
    }
    int ok = enqueued(job, slice);
    pthread_mutex_unlock(&e->mu);
    if (ok) return KVO_OK;
    return kvo_say(msg, KVO_TIMEOUT, "the copy was not enqueued within %g s", timeout);
}

/* A wait on `layer` of the job is a layer's (a load's layer) or the whole job's: the slice it
 * needs enqueued (-1: all of the job) and the flag word it reads. */
static int layered(const kvo_job *job, int64_t layer) {
    return job->dir == KVO_LOAD && layer >= 0 && layer < job->n_layers;
}
static int64_t slice_of(const kvo_job *job, int64_t layer) {
    return layered(job, layer) ? job->layer_slice[layer] : -1;
}
static int64_t word_of(const kvo_core *e, const kvo_job *job, int64_t layer) {
    return layered(job, layer) ? kvo_word_layer(&e->flags, layer) : kvo_word_done(job->dir);
}

/* 1 where kvo_job_wait_on would enqueue nothing and return at once: the layer's slice (the
 * job) enqueued and landed, the job cancelled, or the core closed; *ok as it would say. No
 * blocking, no driver call: the binding calls it without releasing the GIL, so a layer that
 * landed costs the engine's thread no hand-over of the GIL to another Python thread. */
int kvo_job_landed(kvo_core *e, kvo_job *job, int64_t layer, int *ok) {
    if (!enqueued(job, slice_of(job, layer))) return 0;
    /* final for failures found while enqueueing once the job settled; a layer's wait may return
     * before (its slice is enqueued): a later failure still writes every word, and the job
     * reports it. A cancelled job never ran: nothing to wait for, the engine recomputes. */
    *ok = job->cancelled ? 0 : state_of(job) < KVO_INFLIGHT || !job->failed;
    if (job->cancelled || !flags_enter(e)) return 1; /* !flags_enter: closed, everything ended */
    int landed = kvo_flag_reached(&e->flags, word_of(e, job, layer), job->seq);
    flags_leave(e);
    return landed;
}

kvo_status kvo_job_wait_on(kvo_core *e, kvo_job *job, kvo_stream stream, int64_t layer,
                           double timeout, kvo_timer *timer, int *ok, char *msg) {
    *ok = 1;
    kvo_status rc = until_enqueued(e, job, slice_of(job, layer), timeout, msg);
    if (rc != KVO_OK) return rc;
    if (kvo_job_landed(e, job, layer, ok)) return KVO_OK; /* else enqueued, not landed: wait */
    if (!flags_enter(e)) return KVO_OK; /* closed since: everything ended */
    int64_t word = word_of(e, job, layer);
    int err = 0;
    if (!kvo_flag_reached(&e->flags, word, job->seq)) { /* else landed since: nothing to wait */
        void *prev = kvo_ctx_enter(e);
        /* the timer is a report: a record it cannot make leaves the layer untimed, never the
         * wait undone */
        int timed = timer != NULL && layer >= 0 && word == kvo_word_layer(&e->flags, layer) &&
                    kvo_timer_begin(e, timer, layer, stream);
        err = e->d.wait32(stream, e->flags.dev + (kvo_dptr)word * sizeof(uint32_t), job->seq,
                          KVO_WAIT_GEQ);
        if (timed) kvo_timer_end(e, timer, layer, stream, !err);
        kvo_ctx_leave(e, prev);
    }
    flags_leave(e);
    if (err)
        return kvo_say(msg, KVO_FAILED, "cuStreamWaitValue32 failed: %s",
                       kvo_error_name(&e->d, err));
    return KVO_OK;
}

kvo_status kvo_job_describe(kvo_core *e, kvo_job *job, kvo_job_info *out) {
    pthread_mutex_lock(&e->mu);
    out->id = job->id;
    out->dir = job->dir;
    out->slices = job->n_slices;
    out->layers = job->n_layers;
    out->settled = job->state >= KVO_INFLIGHT;
    out->failed = job->failed;
    out->cancelled = job->cancelled;
    out->code = job->code;
    out->step = job->step;
    out->chunk = job->chunk;
    out->desc = job->desc;
    out->t_submit = job->t_submit;
    out->t_start = job->t_start;
    out->t_enqueued = job->t_enqueued;
    out->t_done = job->t_done;
    memcpy(out->message, job->message, sizeof out->message);
    pthread_mutex_unlock(&e->mu);
    return KVO_OK;
}

kvo_status kvo_job_layer_slices(kvo_core *e, kvo_job *job, int64_t *out, int64_t cap,
                                int64_t *n) {
    *n = job->n_slices > 0 ? job->n_layers : 0; /* fixed at submit */
    if (*n > cap) *n = cap;
    memcpy(out, job->layer_slice, (size_t)*n * sizeof *out);
    return KVO_OK;
}

/* -- layer gates ------------------------------------------------------------------------------- */

kvo_status kvo_gate_create(kvo_core *e, int64_t layers, int64_t *gate, char *msg) {
    if (layers < 1 || layers > e->spec.max_layers)
        return kvo_say(msg, KVO_REFUSED, "expected 1 <= layers <= %lld (the layout's), got %lld",
                       (long long)e->spec.max_layers, (long long)layers);
    kvo_status rc = KVO_OK;
    void *prev = kvo_ctx_enter(e);
    pthread_mutex_lock(&e->mu);
    if (e->closing) {
        rc = kvo_say(msg, KVO_FAILED, "expected an open native core, got a closed one");
    } else if (e->gates == KVO_MAX_GATES) {
        rc = kvo_say(msg, KVO_REFUSED, "expected at most %d layer gates per core, got one more",
                     KVO_MAX_GATES);
    } else {
        int err = e->d.event_create(&e->gate_event[e->gates], 2 /* CU_EVENT_DISABLE_TIMING */);
        if (err) {
            rc = kvo_say(msg, KVO_FAILED, "cuEventCreate failed: %s", kvo_error_name(&e->d, err));
        } else {
            e->gate_layers[e->gates] = layers;
            *gate = e->gates++;
        }
    }
    pthread_mutex_unlock(&e->mu);
    kvo_ctx_leave(e, prev);
    return rc;
}

/* The gate, and (with_layer) its layer, or why not. */
static kvo_status check_gate(kvo_core *e, int64_t gate, int with_layer, int64_t layer, char *msg) {
    pthread_mutex_lock(&e->mu);
    int64_t gates = e->gates, layers = gate >= 0 && gate < gates ? e->gate_layers[gate] : 0;
    int closed = e->closing;
    pthread_mutex_unlock(&e->mu);
    if (closed) return kvo_say(msg, KVO_FAILED, "expected an open native core, got a closed one");
    if (gate < 0 || gate >= gates)
        return kvo_say(msg, KVO_REFUSED, "expected a gate in [0, %lld), got %lld",
                       (long long)gates, (long long)gate);
    if (with_layer && (layer < 0 || layer >= layers))
        return kvo_say(msg, KVO_REFUSED, "expected a layer in [0, %lld), got %lld",
                       (long long)layers, (long long)layer);
    return KVO_OK;
}

kvo_status kvo_gate_wait(kvo_core *e, int64_t gate, kvo_stream stream, int64_t layer, char *msg) {
    kvo_status rc = check_gate(e, gate, 1, layer, msg);
    if (rc != KVO_OK) return rc;
    if (!flags_enter(e))
        return kvo_say(msg, KVO_FAILED, "expected an open native core, got a closed one");
    kvo_ops ops; /* one wait: the next open closes the layer again, not the replay */
    kvo_ops_begin(&ops, &e->d, &e->flags, stream);
    kvo_ops_wait(&ops, kvo_word_gate(&e->flags, gate, layer), 1, KVO_WAIT_EQ);
    void *prev = kvo_ctx_enter(e);
    int err = kvo_ops_end(&ops);
    kvo_ctx_leave(e, prev);
    flags_leave(e);
    if (err)
        return kvo_say(msg, KVO_FAILED, "cuStreamWaitValue32 failed: %s",
                       kvo_error_name(&e->d, err));
    return KVO_OK;
}

/* The newest of two sequence numbers (cyclic); 0 is "none". */
static uint32_t newest(uint32_t a, uint32_t b) {
    if (a == 0) return b;
    return b != 0 && (int32_t)(b - a) > 0 ? b : a;
}

kvo_status kvo_gate_open(kvo_core *e, int64_t gate, kvo_stream stream, kvo_job *const *jobs,
                         int64_t n, double timeout, char *msg) {
    kvo_status rc = check_gate(e, gate, 0, 0, msg);
    if (rc != KVO_OK) return rc;
    uint32_t target[2] = {0, 0}; /* per direction: the newest listed job still to land */
    for (int64_t i = 0; i < n; i++)
        if ((rc = until_enqueued(e, jobs[i], -1, timeout, msg)) != KVO_OK) return rc;
    if (!flags_enter(e))
        return kvo_say(msg, KVO_FAILED, "expected an open native core, got a closed one");
    for (int64_t i = 0; i < n; i++) {
        if (jobs[i]->cancelled) continue;
        if (!kvo_flag_reached(&e->flags, kvo_word_done(jobs[i]->dir), jobs[i]->seq))
            target[jobs[i]->dir] = newest(target[jobs[i]->dir], jobs[i]->seq);
    }
    kvo_stream opener = (kvo_stream)e->spec.gate;
    void *prev = kvo_ctx_enter(e);
    /* on `stream`, after the replays enqueued so far (they passed the layers the last open
     * opened) and before the next: every layer closed, in one call; then, on the opener, each
     * layer opens once its loads landed */
    kvo_ops close;
    kvo_ops_begin(&close, &e->d, &e->flags, stream);
    for (int64_t l = 0; l < e->gate_layers[gate]; l++)
        kvo_ops_write(&close, kvo_word_gate(&e->flags, gate, l), 0);
    int err = kvo_ops_end(&close);
    if (!err) err = e->d.record(e->gate_event[gate], stream);
    if (!err) err = e->d.wait(opener, e->gate_event[gate], 0);
    if (!err) {
        kvo_ops ops;
        kvo_ops_begin(&ops, &e->d, &e->flags, opener);
        if (target[KVO_STORE]) kvo_ops_wait(&ops, kvo_word_done(KVO_STORE), target[KVO_STORE], KVO_WAIT_GEQ);
        for (int64_t l = 0; l < e->gate_layers[gate]; l++) {
            if (target[KVO_LOAD])
                kvo_ops_wait(&ops, kvo_word_layer(&e->flags, l), target[KVO_LOAD], KVO_WAIT_GEQ);
            kvo_ops_write(&ops, kvo_word_gate(&e->flags, gate, l), 1);
        }
        err = kvo_ops_end(&ops);
    }
    kvo_ctx_leave(e, prev);
    flags_leave(e);
    if (err)
        return kvo_say(msg, KVO_FAILED, "opening the layer gate failed: %s",
                       kvo_error_name(&e->d, err));
    return KVO_OK;
}

/* -- reports ----------------------------------------------------------------------------------- */

kvo_status kvo_core_finished(kvo_core *e, int64_t **ids, int64_t *n) {
    pthread_mutex_lock(&e->mu);
    e->track_finished = 1;
    *n = e->finished_n;
    *ids = malloc((size_t)(*n > 0 ? *n : 1) * sizeof **ids);
    if (*ids != NULL) {
        memcpy(*ids, e->finished, (size_t)*n * sizeof **ids);
        e->finished_n = 0;
    }
    pthread_mutex_unlock(&e->mu);
    return *ids == NULL ? KVO_FAILED : KVO_OK;
}

kvo_status kvo_core_stats(kvo_core *e, kvo_stats *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&e->mu);
    for (int d = 0; d < 2; d++)
        for (kvo_job *j = e->queue_head[d]; j; j = j->next) out->queued++;
    for (kvo_job *j = e->inflight; j; j = j->next) out->in_flight++;
    out->submitted = e->submitted;
    out->completed = e->completed;
    out->reaped = e->reaped;
    out->failed = e->failures;
    out->parts = e->lane[0].parts + e->lane[1].parts;
    out->closed = e->closing;
    out->batch_copies = e->d.batch != NULL;
    pthread_mutex_unlock(&e->mu);
    return KVO_OK;
}
