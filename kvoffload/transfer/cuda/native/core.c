/* The core's lifecycle (core.h): open, submit (validation, then the enqueue, here or by a
 * worker thread per direction), the completion thread, close. Its state is core_state.h's.
 *
 * Quiet beside the engine's forward: a job is enqueued whole at submit by the caller's thread
 * when its direction is idle (the GIL released), so no thread of ours makes a driver call while
 * the engine launches its forward afterwards (a `background` submit leaves it to the
 * direction's worker thread, for a caller about to wait on the device, not launch); completion
 * is found by reading the flag words the GPU writes (flags.h), not by driver queries, and by
 * whoever asks (a job's done() and wait() read its done word and finish it, waits.c): the
 * completion thread only finishes jobs nobody asks about, sleeping ~1/16 of the youngest job's
 * age (at most poll_max_ns), so no thread of ours polls fast beside the forward. A driver query
 * (cuStreamQuery of the job's tail stream) is made only for a job in flight longer than
 * KVO_ERROR_POLL_S, to report a copy that failed on the device. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "core_state.h"


#define EVENT_POOL_MAX 4096      /* free events kept for reuse */
#define FINISHED_FIRST 256       /* finished-id buffer's first capacity */
#define COMPLETER_BATCH 256      /* in-flight jobs looked at per pass */
#define KVO_ERROR_POLL_S 0.05    /* a job in flight this long gets a driver query this often */
#define PAUSE_MIN_S 10e-6        /* the completion thread's shortest sleep (it never spins) */
#define EVENT_NO_TIMING 2        /* CU_EVENT_DISABLE_TIMING */

void *kvo_ctx_enter(kvo_core *e) {
    void *prev = NULL;
    if (e->ctx == NULL) return NULL;
    if (e->d.ctx_get(&prev) != 0) prev = NULL;
    if (prev != e->ctx) e->d.ctx_set(e->ctx);
    return prev;
}

void kvo_ctx_leave(kvo_core *e, void *prev) {
    if (e->ctx != NULL && prev != e->ctx) e->d.ctx_set(prev);
}

int kvo_timed_wait(kvo_core *e, double deadline) {
    if (deadline <= 0) return pthread_cond_wait(&e->changed, &e->mu);
    struct timespec ts;
    ts.tv_sec = (time_t)deadline;
    ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
    return pthread_cond_timedwait(&e->changed, &e->mu, &ts);
}

/* -- events and job references (mu held) ------------------------------------------------------- */

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

static void job_drop(kvo_core *e, kvo_job *job) {
    event_give(e, job->order);
    kvo_job_free(job);
}

void kvo_unref(kvo_core *e, kvo_job *job) {
    if (--job->refs == 0) job_drop(e, job);
}

void kvo_job_release(kvo_core *e, kvo_job *job) {
    pthread_mutex_lock(&e->mu);
    kvo_unref(e, job);
    pthread_mutex_unlock(&e->mu);
}

void kvo_finish(kvo_core *e, kvo_job *job) {
    job->t_done = kvo_now();
    __atomic_store_n(&job->state, KVO_DONE, __ATOMIC_RELEASE);
    e->completed++;
    if (job->failed) e->failures++;
    if (e->track_finished) {
        if (e->finished_n == e->finished_cap) {
            int64_t cap = e->finished_cap ? 2 * e->finished_cap : FINISHED_FIRST;
            int64_t *p = realloc(e->finished, (size_t)cap * sizeof *p);
            if (p != NULL) {
                e->finished = p;
                e->finished_cap = cap;
            }
        }
        if (e->finished_n < e->finished_cap) e->finished[e->finished_n++] = job->id;
    }
    pthread_cond_broadcast(&e->changed);
    kvo_unref(e, job);
}

/* After a job's enqueue (by a worker or inline by the caller): in flight. */
static void settle(kvo_core *e, kvo_job *job) {
    pthread_mutex_lock(&e->mu);
    job->t_enqueued = kvo_now();
    e->running[job->dir] = 0;
    job->next = e->inflight;
    e->inflight = job;
    __atomic_store_n(&job->state, KVO_INFLIGHT, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&e->changed);
    pthread_cond_signal(&e->work[job->dir]); /* jobs queued meanwhile */
    pthread_mutex_unlock(&e->mu);
}

static void run(kvo_core *e, kvo_job *job) {
    kvo_pipeline_run(&e->pipe, &e->lane[job->dir], job);
    settle(e, job);
}

/* -- submit ------------------------------------------------------------------------------------ */

/* Range and distinct destinations of every spec; mu need not be held. */
static kvo_status validate(kvo_core *e, const kvo_input *in, int64_t n_in, char *msg) {
    const kvo_spec *s = &e->spec;
    for (int64_t i = 0; i < n_in; i++) {
        if (in[i].group < 0 || in[i].group >= s->n_groups)
            return kvo_say(msg, KVO_REFUSED, "expected group in [0, %lld), got %lld",
                           (long long)s->n_groups, (long long)in[i].group);
        int64_t nb = s->groups[in[i].group].num_blocks;
        for (int64_t j = 0; j < in[i].n; j++) {
            if (in[i].blocks[j] < 0 || in[i].blocks[j] >= nb)
                return kvo_say(msg, KVO_REFUSED,
                               "expected every engine block id in [0, %lld), got %lld",
                               (long long)nb, (long long)in[i].blocks[j]);
            if (in[i].slots[j] < 0 || in[i].slots[j] >= s->num_slots)
                return kvo_say(msg, KVO_REFUSED, "expected every host slot in [0, %lld), got %lld",
                               (long long)s->num_slots, (long long)in[i].slots[j]);
        }
    }
    kvo_status rc = KVO_OK;
    pthread_mutex_lock(&e->check_mu);
    /* destinations: a store's slots, a load's blocks, distinct across every spec of one
     * direction and layer group (the specs of a direction are one job: two writes of one place
     * would race) */
    for (int64_t i = 0; i < n_in && rc == KVO_OK; i++) {
        int first = 1; /* the first spec of its (direction, group): checks the whole set */
        for (int64_t k = 0; k < i && first; k++)
            if (in[k].dir == in[i].dir && in[k].group == in[i].group) first = 0;
        if (!first) continue;
        int store = in[i].dir == KVO_STORE;
        uint8_t *seen = store ? e->seen_slots : e->seen_blocks;
        int64_t dups = 0;
        for (int pass = 0; pass < 2; pass++) /* mark, then clear */
            for (int64_t k = i; k < n_in; k++) {
                if (in[k].dir != in[i].dir || in[k].group != in[i].group) continue;
                const int64_t *dst = store ? in[k].slots : in[k].blocks;
                for (int64_t j = 0; j < in[k].n; j++) {
                    uint8_t bit = (uint8_t)(1u << (dst[j] & 7));
                    if (pass == 1) {
                        seen[dst[j] >> 3] = 0;
                        continue;
                    }
                    if (seen[dst[j] >> 3] & bit) dups++;
                    seen[dst[j] >> 3] |= bit;
                }
            }
        if (dups)
            rc = kvo_say(msg, KVO_REFUSED,
                         "expected distinct destination %s in one %s, got %lld duplicates",
                         store ? "host slots" : "engine blocks", store ? "store" : "load",
                         (long long)dups);
    }
    pthread_mutex_unlock(&e->check_mu);
    return rc;
}

static int take_events(kvo_core *e, kvo_job *job, int has_order) { /* mu held */
    int err = 0;
    if (has_order) job->order = event_take(e, &err);
    return err;
}

static void drop_all(kvo_core *e, kvo_job **jobs) {
    pthread_mutex_lock(&e->mu);
    for (int d = 0; d < 2; d++)
        if (jobs[d]) job_drop(e, jobs[d]);
    pthread_mutex_unlock(&e->mu);
}

kvo_status kvo_core_submit(kvo_core *e, const kvo_input *in, int64_t n_in, kvo_stream order,
                             int has_order, int background, kvo_job **out, int *n_out,
                             char *msg) {
    *n_out = 0;
    kvo_status rc = validate(e, in, n_in, msg);
    if (rc != KVO_OK) return rc;
    int oom = 0;
    kvo_job *jobs[2] = {kvo_job_build(&e->spec, in, n_in, KVO_STORE, &oom),
                        kvo_job_build(&e->spec, in, n_in, KVO_LOAD, &oom)};
    if (oom || (!jobs[0] && !jobs[1])) {
        drop_all(e, jobs);
        return kvo_say(msg, KVO_FAILED, "out of host memory for the job");
    }
    void *prev = kvo_ctx_enter(e); /* events and the order record need our context */
    pthread_mutex_lock(&e->mu);
    if (e->closing) rc = kvo_say(msg, KVO_FAILED, "submit: expected an open native core, got a closed one");
    for (int d = 0; d < 2 && rc == KVO_OK; d++) {
        int err = jobs[d] ? take_events(e, jobs[d], has_order) : 0;
        if (err) rc = kvo_say(msg, KVO_FAILED, "cuEventCreate failed: %s", kvo_error_name(&e->d, err));
    }
    pthread_mutex_unlock(&e->mu);
    /* the order event, recorded in the caller's thread on its stream: copies start after it */
    for (int d = 0; d < 2 && rc == KVO_OK; d++) {
        if (jobs[d] == NULL || jobs[d]->order == NULL) continue;
        int err = e->d.record(jobs[d]->order, order);
        if (err)
            rc = kvo_say(msg, KVO_FAILED, "cuEventRecord on the caller's stream failed: %s",
                         kvo_error_name(&e->d, err));
    }
    if (rc != KVO_OK) {
        drop_all(e, jobs);
        kvo_ctx_leave(e, prev);
        return rc;
    }
    double now = kvo_now();
    int here[2] = {0, 0};
    pthread_mutex_lock(&e->mu);
    if (e->closing) { /* close began since the check above: nothing of these jobs ran */
        pthread_mutex_unlock(&e->mu);
        drop_all(e, jobs);
        kvo_ctx_leave(e, prev);
        return kvo_say(msg, KVO_FAILED, "submit: expected an open native core, got a closed one");
    }
    for (int d = 0; d < 2; d++) {
        kvo_job *job = jobs[d];
        if (job == NULL) continue;
        job->id = e->next_id++;
        job->t_submit = now;
        job->refs = 2; /* the caller's, the core's */
        e->submitted++;
        out[(*n_out)++] = job;
        if (!background && e->queue_head[d] == NULL && !e->running[d] &&
            kvo_job_bytes(job, &e->spec) <= e->spec.inline_bytes) {
            job->state = KVO_RUNNING; /* enqueued here, without waking a thread */
            job->t_start = now;
            e->running[d] = 1;
            here[d] = 1;
            continue;
        }
        job->state = KVO_QUEUED;
        if (e->queue_tail[d]) e->queue_tail[d]->next = job;
        else e->queue_head[d] = job;
        e->queue_tail[d] = job;
        pthread_cond_signal(&e->work[d]);
    }
    pthread_mutex_unlock(&e->mu);
    for (int d = 0; d < 2; d++)
        if (here[d]) run(e, jobs[d]);
    kvo_ctx_leave(e, prev);
    return KVO_OK;
}

/* -- threads ----------------------------------------------------------------------------------- */

typedef struct { kvo_core *e; int dir; } worker_arg;

static void *worker(void *p) {
    worker_arg *a = p;
    kvo_core *e = a->e;
    int dir = a->dir;
    free(a);
    if (e->ctx) e->d.ctx_set(e->ctx);
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while ((e->queue_head[dir] == NULL || e->running[dir]) && !e->closing)
            pthread_cond_wait(&e->work[dir], &e->mu);
        while (e->running[dir]) pthread_cond_wait(&e->work[dir], &e->mu); /* closing: inline */
        kvo_job *job = e->queue_head[dir];
        if (job == NULL) {
            pthread_mutex_unlock(&e->mu);
            return NULL;
        }
        e->queue_head[dir] = job->next;
        if (e->queue_head[dir] == NULL) e->queue_tail[dir] = NULL;
        job->next = NULL;
        job->state = KVO_RUNNING;
        job->t_start = kvo_now();
        e->running[dir] = 1;
        pthread_mutex_unlock(&e->mu);
        run(e, job);
    }
}

/* 1 finished (0 ok or a device error code in *code), 0 still running. */
static int check(kvo_core *e, kvo_job *j, double now, int *code) {
    *code = 0;
    if (kvo_flag_reached(&e->flags, kvo_word_done(j->dir), j->seq)) return 1;
    if (j->tail == NULL || now - j->t_enqueued < KVO_ERROR_POLL_S ||
        now - j->t_polled < KVO_ERROR_POLL_S)
        return 0;
    j->t_polled = now;
    /* the tail stream, not an event of the job's own: one driver call fewer per job. Later
     * jobs' work on it keeps it not ready; a copy that failed on the device fails it. */
    int q = e->d.stream_query(j->tail);
    if (q == 0 || q == KVO_NOT_READY) return 0; /* 0: the flag's write is about to land */
    *code = q;
    return 1;
}

static void *completer(void *p) {
    kvo_core *e = p;
    if (e->ctx) e->d.ctx_set(e->ctx);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* 1 us: short sleeps stay short */
    kvo_job *batch[COMPLETER_BATCH];
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (e->inflight == NULL && !(e->closing && e->workers_exited))
            pthread_cond_wait(&e->changed, &e->mu);
        if (e->inflight == NULL) {
            pthread_mutex_unlock(&e->mu);
            return NULL;
        }
        int n = 0;
        double youngest = 1e30, now = kvo_now();
        for (kvo_job *j = e->inflight; j != NULL && n < COMPLETER_BATCH; j = j->next) {
            j->refs++; /* kept while we look outside the lock */
            batch[n++] = j;
            if (now - j->t_start < youngest) youngest = now - j->t_start;
        }
        pthread_mutex_unlock(&e->mu);
        int codes[COMPLETER_BATCH], ended[COMPLETER_BATCH], any = 0;
        for (int i = 0; i < n; i++) any |= ended[i] = check(e, batch[i], now, &codes[i]);
        pthread_mutex_lock(&e->mu);
        for (int i = 0; i < n; i++) {
            kvo_job *j = batch[i];
            if (ended[i] && j->state == KVO_INFLIGHT) { /* not finished by an asker since */
                if (codes[i] != 0)
                    kvo_job_fail(j, &e->d, codes[i], STEP_QUERY, -1, -1, "the copy failed on the device");
                kvo_end_locked(e, j);
            }
            kvo_unref(e, j);
        }
        pthread_mutex_unlock(&e->mu);
        if (!any) { /* read again after ~1/16 of the youngest job's age, in [PAUSE_MIN_S,
                     * poll_max_ns]: askers (done, wait) read the words themselves */
            double pause = youngest / 16, most = (double)e->spec.poll_max_ns * 1e-9;
            if (pause > most) pause = most;
            if (pause < PAUSE_MIN_S) pause = PAUSE_MIN_S;
            struct timespec ts = {(time_t)pause, (long)((pause - (double)(time_t)pause) * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
}

/* -- open and close ---------------------------------------------------------------------------- */

static kvo_status start(kvo_core *e, char *msg) {
    int64_t most_blocks = 1;
    for (int64_t g = 0; g < e->spec.n_groups; g++)
        if (e->spec.groups[g].num_blocks > most_blocks) most_blocks = e->spec.groups[g].num_blocks;
    e->seen_slots = calloc((size_t)(e->spec.num_slots / 8 + 1), 1);
    e->seen_blocks = calloc((size_t)(most_blocks / 8 + 1), 1);
    if (!e->seen_slots || !e->seen_blocks) return kvo_say(msg, KVO_FAILED, "out of host memory");
    if (e->d.ctx_get(&e->ctx) != 0) e->ctx = NULL;
    int err = kvo_flags_init(&e->flags, &e->d, e->spec.max_layers, KVO_MAX_GATES,
                             (kvo_stream)e->spec.gate);
    if (err)
        return kvo_say(msg, KVO_FAILED, "the flag words (host and device memory) failed: %s",
                       kvo_error_name(&e->d, err));
    e->pipe = (kvo_pipe){&e->d, &e->spec, &e->flags};
    for (int d = 0; d < 2; d++)
        if ((err = kvo_lane_init(&e->lane[d], &e->pipe, d)) != 0)
            return kvo_say(msg, KVO_FAILED, "the staging ring's events and buffers failed: %s",
                           kvo_error_name(&e->d, err));
    for (int d = 0; d < 2; d++) {
        worker_arg *a = malloc(sizeof *a);
        if (a == NULL) return kvo_say(msg, KVO_FAILED, "out of host memory");
        *a = (worker_arg){e, d};
        if (pthread_create(&e->worker[d], NULL, worker, a) != 0) {
            free(a);
            return kvo_say(msg, KVO_FAILED, "could not start a worker thread");
        }
        e->threads_started |= 1 << d;
    }
    if (pthread_create(&e->completer, NULL, completer, e) != 0)
        return kvo_say(msg, KVO_FAILED, "could not start the completion thread");
    e->threads_started |= 4;
    return KVO_OK;
}

kvo_status kvo_core_open(const kvo_driver *d, const int64_t *spec, int64_t n, kvo_core **out,
                           char *msg) {
    *out = NULL;
    kvo_core *e = calloc(1, sizeof *e);
    if (e == NULL) return kvo_say(msg, KVO_FAILED, "out of host memory");
    e->d = *d;
    kvo_status rc = kvo_spec_parse(&e->spec, spec, n, msg);
    if (rc != KVO_OK) {
        free(e);
        return rc;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->check_mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&e->work[0], &attr);
    pthread_cond_init(&e->work[1], &attr);
    pthread_cond_init(&e->changed, &attr);
    pthread_condattr_destroy(&attr);
    rc = start(e, msg);
    if (rc != KVO_OK) {
        kvo_core_free(e);
        return rc;
    }
    *out = e;
    return KVO_OK;
}

/* Stop taking jobs, cancel the queued ones, let the workers finish the one in hand, wait for
 * everything in flight; then open every gate (a graph replay still waiting is released), wait
 * for the context (streams that wait on our flag words), and free what the core holds. */
void kvo_core_close(kvo_core *e) {
    pthread_mutex_lock(&e->mu);
    if (e->closing) {
        pthread_mutex_unlock(&e->mu);
        return;
    }
    e->closing = 1;
    for (int d = 0; d < 2; d++) {
        while (e->queue_head[d] != NULL) {
            kvo_job *job = e->queue_head[d];
            e->queue_head[d] = job->next;
            job->next = NULL;
            job->cancelled = 1;
            kvo_job_fail(job, &e->d, 0, STEP_CLOSED, -1, -1, "the core closed before it started");
            kvo_finish(e, job);
        }
        e->queue_tail[d] = NULL;
        pthread_cond_broadcast(&e->work[d]);
    }
    pthread_mutex_unlock(&e->mu);
    for (int d = 0; d < 2; d++)
        if (e->threads_started & (1 << d)) pthread_join(e->worker[d], NULL);
    pthread_mutex_lock(&e->mu);
    while (e->running[0] || e->running[1]) pthread_cond_wait(&e->changed, &e->mu); /* inline */
    e->workers_exited = 1;
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->mu);
    if (e->threads_started & 4) pthread_join(e->completer, NULL);
    e->threads_started = 0;
    /* every job has ended: later waits enqueue nothing; those reading the words now finish
     * first (Dekker with kvo_flags_enter: both sides sequentially consistent) */
    __atomic_store_n(&e->closed, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&e->flag_users, __ATOMIC_SEQ_CST) > 0) CPU_RELAX();
    void *prev = kvo_ctx_enter(e);
    if (e->flags.host != NULL) { /* open every gate: a replay waiting on one passes */
        kvo_ops ops;
        kvo_ops_begin(&ops, &e->d, &e->flags, (kvo_stream)e->spec.gate);
        for (int64_t g = 0; g < e->gates; g++)
            for (int64_t l = 0; l < e->gate_layers[g]; l++)
                kvo_ops_write(&ops, kvo_word_gate(&e->flags, g, l), 1);
        (void)kvo_ops_end(&ops); /* refused only by a context that failed (a sticky error) */
        e->d.ctx_sync();
    }
    for (int d = 0; d < 2; d++) kvo_lane_free(&e->lane[d], &e->pipe);
    for (int64_t g = 0; g < e->gates; g++)
        if (e->gate_event[g]) e->d.event_destroy(e->gate_event[g]);
    kvo_flags_free(&e->flags, &e->d);
    pthread_mutex_lock(&e->mu);
    while (e->pool_n > 0) e->d.event_destroy(e->pool[--e->pool_n]);
    pthread_mutex_unlock(&e->mu);
    kvo_ctx_leave(e, prev);
}

void kvo_core_free(kvo_core *e) {
    if (e == NULL) return;
    kvo_core_close(e);
    kvo_spec_free(&e->spec);
    free(e->seen_slots);
    free(e->seen_blocks);
    free(e->finished);
    free(e->pool);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->check_mu);
    free(e);
}
