/* The engine's job path: validation at submit, a queue and a worker thread per direction, a
 * completion thread that polls the jobs' done events, and the waits Python calls with the GIL
 * released. Locking: one mutex (mu) for queues, job states and the event pool; `changed` is
 * broadcast on every state change (waiters re-check their condition). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "kvo.h"

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

double kvo_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *STEP_NAMES[] = {"",          "cuLaunchKernel", "copy", "cuEventRecord",
                                   "cuStreamWaitEvent", "allocation", "kernel argument",
                                   "cuEventQuery", "cancel", "close"};

/* Record the job's first failure (later ones keep the first message); returns code. */
int kvo_fail(kvo_job *job, const kvo_driver *d, int code, int step, int64_t chunk, int64_t desc,
             const char *what) {
    if (job->failed) return code ? code : 1;
    job->failed = 1;
    job->code = code;
    job->step = step;
    job->chunk = chunk;
    job->desc = desc;
    const char *name = step == STEP_CANCEL || step == STEP_CLOSED || step == STEP_ARG ||
                               step == STEP_ALLOC
                           ? ""
                           : kvo_error_name(d, code);
    char where[80] = "";
    if (chunk >= 0) snprintf(where, sizeof where, " of chunk %lld", (long long)chunk);
    if (step == STEP_COPY && desc >= 0)
        snprintf(job->message, sizeof job->message, "copy%s failed with %s at descriptor %lld",
                 where, name, (long long)desc);
    else
        snprintf(job->message, sizeof job->message, "%s%s failed%s%s%s%s", STEP_NAMES[step], where,
                 *name ? " with " : "", name, what ? ": " : "", what ? what : "");
    return code ? code : 1;
}

kvo_event kvo_event_take(kvo_engine *e, int *err) {
    kvo_event ev = NULL;
    if (e->pool_n > 0) return e->pool[--e->pool_n];
    *err = e->d.event_create(&ev, 2 /* CU_EVENT_DISABLE_TIMING */);
    return ev;
}

void kvo_event_give(kvo_engine *e, kvo_event ev) {
    if (ev == NULL) return;
    if (e->closing || (e->pool_n == e->pool_cap && e->pool_cap >= 4096)) {
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

static void job_free(kvo_engine *e, kvo_job *job) { /* mu held */
    kvo_event_give(e, job->order);
    kvo_event_give(e, job->done_ev);
    for (int64_t k = 0; k < job->n_slices && job->slices; k++) kvo_event_give(e, job->slices[k]);
    free(job->slices);
    free(job->group);
    free(job->ids);
    free(job->layer_slice);
    free(job);
}

static void unref(kvo_engine *e, kvo_job *job) { /* mu held */
    if (--job->refs == 0) job_free(e, job);
}

void kvo_job_release(kvo_engine *e, kvo_job *job) {
    pthread_mutex_lock(&e->mu);
    unref(e, job);
    pthread_mutex_unlock(&e->mu);
}

static void finish(kvo_engine *e, kvo_job *job) { /* mu held; drops the engine's reference */
    __atomic_store_n(&job->state, KVO_DONE, __ATOMIC_RELEASE);
    job->t_done = kvo_now();
    e->completed++;
    if (job->failed) e->failures++;
    if (e->track_finished) {
        if (e->finished_n == e->finished_cap) {
            int64_t cap = e->finished_cap ? 2 * e->finished_cap : 256;
            int64_t *p = realloc(e->finished, (size_t)cap * sizeof *p);
            if (p != NULL) {
                e->finished = p;
                e->finished_cap = cap;
            }
        }
        if (e->finished_n < e->finished_cap) e->finished[e->finished_n++] = job->id;
    }
    pthread_cond_broadcast(&e->changed);
    unref(e, job);
}

void *kvo_ctx_enter(kvo_engine *e) {
    void *prev = NULL;
    if (e->ctx == NULL) return NULL;
    if (e->d.ctx_get(&prev) != 0) prev = NULL;
    if (prev != e->ctx) e->d.ctx_set(e->ctx);
    return prev;
}

void kvo_ctx_leave(kvo_engine *e, void *prev) {
    if (e->ctx != NULL && prev != e->ctx) e->d.ctx_set(prev);
}

/* After a job's enqueue (by its worker or inline by the caller): in flight, or finished where
 * its completion event could not be recorded (its streams were synchronized). */
static void settle(kvo_engine *e, kvo_job *job) {
    pthread_mutex_lock(&e->mu);
    job->t_enqueued = kvo_now();
    e->running[job->dir] = 0;
    if (job->done_recorded) {
        job->state = KVO_INFLIGHT;
        job->next = e->inflight;
        e->inflight = job;
    } else {
        finish(e, job);
    }
    pthread_cond_broadcast(&e->changed);
    pthread_cond_signal(&e->work[job->dir]); /* jobs queued meanwhile */
    pthread_mutex_unlock(&e->mu);
}

/* -- submit ------------------------------------------------------------------------------------ */

static int refuse(char *err, size_t len, const char *fmt, long long a, long long b) {
    snprintf(err, len, fmt, a, b);
    return 1;
}

/* Range and distinct destinations of every spec; mu need not be held. */
static int validate(kvo_engine *e, const kvo_input *in, int64_t n_in, char *err, size_t len) {
    const kvo_spec *s = &e->spec;
    for (int64_t i = 0; i < n_in; i++) {
        if (in[i].group < 0 || in[i].group >= s->n_groups)
            return refuse(err, len, "expected group in [0, %lld), got %lld",
                          (long long)s->n_groups, (long long)in[i].group);
        int64_t nb = s->groups[in[i].group].num_blocks;
        for (int64_t j = 0; j < in[i].n; j++) {
            if (in[i].blocks[j] < 0 || in[i].blocks[j] >= nb)
                return refuse(err, len, "expected every engine block id in [0, %lld), got %lld",
                              (long long)nb, (long long)in[i].blocks[j]);
            if (in[i].slots[j] < 0 || in[i].slots[j] >= s->num_slots)
                return refuse(err, len, "expected every host slot in [0, %lld), got %lld",
                              (long long)s->num_slots, (long long)in[i].slots[j]);
        }
    }
    int bad = 0;
    pthread_mutex_lock(&e->check_mu);
    for (int64_t i = 0; i < n_in && !bad; i++) { /* destinations: slots of a store, blocks of a load */
        int store = in[i].dir == KVO_STORE;
        const int64_t *dst = store ? in[i].slots : in[i].blocks;
        uint8_t *seen = store ? e->seen_slots : e->seen_blocks;
        int64_t dups = 0;
        for (int64_t j = 0; j < in[i].n; j++) {
            uint8_t bit = (uint8_t)(1u << (dst[j] & 7));
            if (seen[dst[j] >> 3] & bit) dups++;
            seen[dst[j] >> 3] |= bit;
        }
        for (int64_t j = 0; j < in[i].n; j++) seen[dst[j] >> 3] = 0;
        if (dups) {
            snprintf(err, len, "expected distinct destination %s in one %s, got %lld duplicates",
                     store ? "host slots" : "engine blocks", store ? "store" : "load",
                     (long long)dups);
            bad = 1;
        }
    }
    pthread_mutex_unlock(&e->check_mu);
    return bad;
}

/* The load schedule of each spec: the one with the most slices that keeps one slice per
 * min_slice_transfer_bytes of the job (kvoffload.transfer.cuda.base._load_plan). */
static void plan_load(kvo_engine *e, kvo_job *job) {
    int64_t nbytes = 0;
    for (int64_t i = 0; i < job->n_specs; i++)
        nbytes += job->count[i] * e->spec.groups[job->group[i]].slot_bytes;
    int64_t room = nbytes / e->spec.min_slice_transfer_bytes;
    if (room < 1) room = 1;
    job->n_slices = 0;
    for (int64_t l = 0; l < job->n_layers; l++) job->layer_slice[l] = 0;
    for (int64_t i = 0; i < job->n_specs; i++) {
        const kvo_group *g = &e->spec.groups[job->group[i]];
        int64_t best = 0;
        for (int64_t k = 0; k < g->n_plans; k++) /* a later schedule of a tie has smaller slices */
            if ((g->plan_count[k] <= room || g->plan_count[k] == 1) &&
                g->plan_count[k] >= g->plan_count[best])
                best = k;
        job->plan_first[i] = g->plan_first[best];
        job->plan_count[i] = g->plan_count[best];
        if (job->plan_count[i] > job->n_slices) job->n_slices = job->plan_count[i];
        for (int64_t l = 0; l < g->n_layers; l++) {
            int64_t o = g->plan_owner[best * g->n_layers + l];
            if (o > job->layer_slice[l]) job->layer_slice[l] = o;
        }
    }
}

static kvo_job *build(kvo_engine *e, const kvo_input *in, int64_t n_in, int dir) {
    int64_t n_specs = 0, total = 0;
    for (int64_t i = 0; i < n_in; i++)
        if (in[i].dir == dir) {
            n_specs++;
            total += in[i].n;
        }
    if (n_specs == 0) return NULL;
    kvo_job *job = calloc(1, sizeof *job);
    if (job == NULL) return NULL;
    job->dir = dir;
    job->n_specs = n_specs;
    job->total = total;
    job->group = calloc((size_t)(5 * n_specs), sizeof(int64_t));
    job->ids = malloc((size_t)(2 * total + 1) * sizeof(int64_t));
    job->n_layers = dir == KVO_LOAD ? e->spec.max_layers : 0;
    job->layer_slice = calloc((size_t)(job->n_layers + 1), sizeof(int64_t));
    if (!job->group || !job->ids || !job->layer_slice) {
        free(job->group);
        free(job->ids);
        free(job->layer_slice);
        free(job);
        return NULL;
    }
    job->count = job->group + n_specs;
    job->at = job->count + n_specs;
    job->plan_first = job->at + n_specs;
    job->plan_count = job->plan_first + n_specs;
    int64_t s = 0, at = 0;
    for (int64_t i = 0; i < n_in; i++) {
        if (in[i].dir != dir) continue;
        job->group[s] = in[i].group;
        job->count[s] = in[i].n;
        job->at[s] = at;
        memcpy(job->ids + at, in[i].blocks, (size_t)in[i].n * 8);
        memcpy(job->ids + at + in[i].n, in[i].slots, (size_t)in[i].n * 8);
        at += 2 * in[i].n;
        s++;
    }
    if (dir == KVO_LOAD) plan_load(e, job);
    return job;
}

static int take_events(kvo_engine *e, kvo_job *job, int has_order) { /* mu held */
    int err = 0;
    job->done_ev = kvo_event_take(e, &err);
    if (!err && has_order) job->order = kvo_event_take(e, &err);
    if (!err && job->n_slices > 0) {
        job->slices = calloc((size_t)job->n_slices, sizeof(kvo_event));
        if (job->slices == NULL) return 2;
        for (int64_t k = 0; k < job->n_slices && !err; k++) job->slices[k] = kvo_event_take(e, &err);
    }
    return err;
}

int kvo_engine_submit(kvo_engine *e, const kvo_input *in, int64_t n_in, kvo_stream order,
                      int has_order, kvo_job **out, int *n_out, char *err, size_t err_len) {
    *n_out = 0;
    if (validate(e, in, n_in, err, err_len)) return 1;
    kvo_job *jobs[2] = {build(e, in, n_in, KVO_STORE), build(e, in, n_in, KVO_LOAD)};
    void *prev = kvo_ctx_enter(e); /* events and the order record need our context */
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (e->closing) {
        snprintf(err, err_len, "submit: expected an open native engine, got a closed one");
        rc = -1;
    }
    for (int d = 0; d < 2 && !rc; d++) {
        if (jobs[d] == NULL) continue;
        int ev_err = take_events(e, jobs[d], has_order);
        if (ev_err) {
            snprintf(err, err_len, "cuEventCreate failed: %s", kvo_error_name(&e->d, ev_err));
            rc = -1;
        }
    }
    if (!rc && !jobs[0] && !jobs[1]) {
        snprintf(err, err_len, "out of host memory for the job");
        rc = -1;
    }
    if (rc) {
        for (int d = 0; d < 2; d++)
            if (jobs[d]) job_free(e, jobs[d]);
        pthread_mutex_unlock(&e->mu);
        kvo_ctx_leave(e, prev);
        return rc;
    }
    pthread_mutex_unlock(&e->mu);
    /* the order event, recorded in the caller's thread on its stream: copies start after it */
    for (int d = 0; d < 2; d++) {
        if (jobs[d] == NULL || jobs[d]->order == NULL) continue;
        int r = e->d.record(jobs[d]->order, order);
        if (r) {
            snprintf(err, err_len, "cuEventRecord on the caller's stream failed: %s",
                     kvo_error_name(&e->d, r));
            pthread_mutex_lock(&e->mu);
            for (int k = 0; k < 2; k++)
                if (jobs[k]) job_free(e, jobs[k]);
            pthread_mutex_unlock(&e->mu);
            kvo_ctx_leave(e, prev);
            return -1;
        }
    }
    double now = kvo_now();
    int here[2] = {0, 0};
    pthread_mutex_lock(&e->mu);
    for (int d = 0; d < 2; d++) {
        kvo_job *job = jobs[d];
        if (job == NULL) continue;
        job->id = e->next_id++;
        job->t_submit = now;
        job->refs = 2; /* the Python Job, the engine */
        e->submitted++;
        out[(*n_out)++] = job;
        int64_t nbytes = 0;
        for (int64_t i = 0; i < job->n_specs; i++)
            nbytes += job->count[i] * e->spec.groups[job->group[i]].slot_bytes;
        if (e->queue_head[d] == NULL && !e->running[d] && nbytes <= e->spec.inline_bytes) {
            /* the direction is idle and the job small: enqueue it here, without waking a
             * thread (the GIL is released; the caller spends the driver calls' time) */
            job->state = KVO_RUNNING;
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
    for (int d = 0; d < 2; d++) {
        if (!here[d]) continue;
        kvo_run_job(e, jobs[d]);
        settle(e, jobs[d]);
    }
    kvo_ctx_leave(e, prev);
    return 0;
}

/* -- threads ----------------------------------------------------------------------------------- */

typedef struct { kvo_engine *e; int dir; } worker_arg;

static void *worker(void *p) {
    worker_arg *a = p;
    kvo_engine *e = a->e;
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
        kvo_run_job(e, job);
        settle(e, job);
    }
}

static void *completer(void *p) {
    kvo_engine *e = p;
    if (e->ctx) e->d.ctx_set(e->ctx);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* 1 us: short sleeps stay short */
    kvo_job *batch[256];
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
        for (kvo_job *j = e->inflight; j != NULL && n < 256; j = j->next) {
            j->refs++; /* kept while we query outside the lock */
            batch[n++] = j;
            if (now - j->t_start < youngest) youngest = now - j->t_start;
        }
        pthread_mutex_unlock(&e->mu);
        int codes[256], any = 0;
        for (int i = 0; i < n; i++) {
            codes[i] = e->d.event_query(batch[i]->done_ev);
            if (codes[i] != KVO_NOT_READY) any = 1;
        }
        pthread_mutex_lock(&e->mu);
        for (int i = 0; i < n; i++) {
            kvo_job *j = batch[i];
            if (codes[i] != KVO_NOT_READY) {
                if (codes[i] != 0) kvo_fail(j, &e->d, codes[i], STEP_QUERY, -1, -1, "the copy failed on the device");
                kvo_job **pp = &e->inflight;
                while (*pp != j) pp = &(*pp)->next;
                *pp = j->next;
                j->next = NULL;
                finish(e, j);
            }
            unref(e, j);
        }
        pthread_mutex_unlock(&e->mu);
        if (!any) { /* poll again after ~1/16 of the youngest job's age, at most 200 us: a
                       * small transfer is seen done within a few us of its end, a long one
                       * costs a poll per 200 us; under 10 us the thread spins (a sleep that
                       * short overshoots) */
            double pause = youngest / 16;
            if (pause > 200e-6) pause = 200e-6;
            if (pause < 10e-6) {
                double until = kvo_now() + pause;
                while (kvo_now() < until) CPU_RELAX();
            } else {
                struct timespec ts = {0, (long)(pause * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
    }
}

const char *kvo_engine_start(kvo_engine *e) {
    static __thread char why[160];
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->check_mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&e->work[0], &attr);
    pthread_cond_init(&e->work[1], &attr);
    pthread_cond_init(&e->changed, &attr);
    pthread_condattr_destroy(&attr);
    int64_t most_blocks = 1;
    for (int64_t g = 0; g < e->spec.n_groups; g++)
        if (e->spec.groups[g].num_blocks > most_blocks) most_blocks = e->spec.groups[g].num_blocks;
    e->seen_slots = calloc((size_t)(e->spec.num_slots / 8 + 1), 1);
    e->seen_blocks = calloc((size_t)(most_blocks / 8 + 1), 1);
    if (!e->seen_slots || !e->seen_blocks) return "out of host memory";
    if (e->d.ctx_get(&e->ctx) != 0) e->ctx = NULL;
    for (int d = 0; d < 2; d++) {
        int err = kvo_lane_init(e, d);
        if (err) {
            snprintf(why, sizeof why, "cuEventCreate failed: %s", kvo_error_name(&e->d, err));
            return why;
        }
    }
    for (int d = 0; d < 2; d++) {
        worker_arg *a = malloc(sizeof *a);
        if (a == NULL) return "out of host memory";
        a->e = e;
        a->dir = d;
        if (pthread_create(&e->worker[d], NULL, worker, a) != 0) {
            free(a);
            return "could not start a worker thread";
        }
        e->threads_started |= 1 << d;
    }
    if (pthread_create(&e->completer, NULL, completer, e) != 0)
        return "could not start the completion thread";
    e->threads_started |= 4;
    return NULL;
}

/* Stop taking jobs, cancel the queued ones, let the workers finish the one in hand, wait for
 * everything in flight, then free what the engine holds. */
void kvo_engine_close(kvo_engine *e) {
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
            kvo_fail(job, &e->d, 0, STEP_CLOSED, -1, -1, "the engine closed before it started");
            finish(e, job);
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
    for (int d = 0; d < 2; d++) kvo_lane_free(e, &e->lane[d]);
    pthread_mutex_lock(&e->mu);
    while (e->pool_n > 0) e->d.event_destroy(e->pool[--e->pool_n]);
    pthread_mutex_unlock(&e->mu);
}

/* -- waits (called without the GIL) ------------------------------------------------------------ */

static int timed_wait(kvo_engine *e, double deadline) { /* mu held; 0 or ETIMEDOUT */
    if (deadline <= 0) {
        pthread_cond_wait(&e->changed, &e->mu);
        return 0;
    }
    struct timespec ts;
    ts.tv_sec = (time_t)deadline;
    ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
    return pthread_cond_timedwait(&e->changed, &e->mu, &ts);
}

/* A waiter spins this long on a job in flight before it sleeps: a condition-variable wake-up
 * costs ~20 us (H100 VM), more than a small transfer's remaining time. */
#define SPIN_S 100e-6

int kvo_job_wait(kvo_engine *e, kvo_job *job, double timeout) {
    double deadline = timeout < 0 ? 0 : kvo_now() + timeout;
    if (timeout != 0) {
        double until = kvo_now() + (timeout > 0 && timeout < SPIN_S ? timeout : SPIN_S);
        while (__atomic_load_n(&job->state, __ATOMIC_ACQUIRE) != KVO_DONE && kvo_now() < until)
            CPU_RELAX();
    }
    pthread_mutex_lock(&e->mu);
    while (job->state != KVO_DONE) {
        if (timeout == 0 || (timed_wait(e, deadline) == ETIMEDOUT && job->state != KVO_DONE)) {
            pthread_mutex_unlock(&e->mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return 1;
}

/* Until slice k's event is recorded (1) or the job's enqueue ended without it (0); -1: timeout. */
int kvo_job_wait_slice(kvo_engine *e, kvo_job *job, int64_t k, double timeout) {
    double deadline = kvo_now() + timeout;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (job->recorded > k) break;
        if (job->state >= KVO_INFLIGHT) {
            pthread_mutex_unlock(&e->mu);
            return 0;
        }
        if (timed_wait(e, deadline) == ETIMEDOUT && job->recorded <= k && job->state < KVO_INFLIGHT) {
            pthread_mutex_unlock(&e->mu);
            return -1;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return 1;
}

int kvo_job_cancel(kvo_engine *e, kvo_job *job) {
    int ok = 0;
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
            kvo_fail(job, &e->d, 0, STEP_CANCEL, -1, -1, "cancelled before it started");
            finish(e, job);
            ok = 1;
        }
    } else if (job->state == KVO_DONE && job->cancelled) {
        ok = 1;
    }
    pthread_mutex_unlock(&e->mu);
    return ok;
}
