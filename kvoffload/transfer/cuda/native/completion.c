/* The completion thread (core_state.h): it finishes the jobs nobody asks about (askers finish
 * their own, waits.c), and it bounds early waits.
 *
 * Early waits. A GPU-side wait may name a load's layer words before its copies are enqueued (a
 * load handed to the worker thread, `background`): the engine's thread never waits for our
 * enqueue. Should that enqueue not finish (a thread of ours blocked in the driver, e.g. behind a lazy module load on
 * the engine's thread, which waits for the device to go idle while the device waits on our
 * words), the completion thread releases the job at its release time: once every load already
 * enqueued has landed (their word writes come first), it marks the load in hand and every queued
 * one released and writes their layer words on the host, so every wait on them passes and each
 * reports failed (the engine recomputes). A released job enqueued later writes only its words
 * (pipeline.c); one released mid-enqueue still finishes its copies, into blocks the engine holds
 * until the job ends, as a timed-out load's. */
#define _GNU_SOURCE
#include <sys/prctl.h>
#include <time.h>

#include "core_state.h"

#define COMPLETER_BATCH 256      /* in-flight jobs looked at per pass */
#define KVO_ERROR_POLL_S 0.05    /* a job in flight this long gets a driver query this often */
#define PAUSE_MIN_S 10e-6        /* the completion thread's shortest sleep (it never spins) */

int kvo_mark_early(kvo_core *e, kvo_job *job, double timeout) {
    if (job->released || job->cancelled) return 1;
    if (job->state >= KVO_INFLIGHT) return 0;
    double at = kvo_now() + timeout;
    if (!job->early) {
        job->early = 1;
        job->release_at = at;
        e->early_n++;
        pthread_cond_broadcast(&e->changed); /* the completion thread keeps the time */
    } else if (at < job->release_at) {
        job->release_at = at;
    }
    return 0;
}

double kvo_next_release(kvo_core *e) {
    double at = 0;
    kvo_job *cur = e->current[KVO_LOAD];
    if (cur != NULL && cur->early && !cur->released) at = cur->release_at;
    for (kvo_job *j = e->queue_head[KVO_LOAD]; j != NULL; j = j->next)
        if (j->early && !j->released && (at == 0 || j->release_at < at)) at = j->release_at;
    return at;
}

void kvo_release_stuck(kvo_core *e, double now) {
    double at = kvo_next_release(e);
    if (at == 0 || now < at) return;
    for (kvo_job *j = e->inflight; j != NULL; j = j->next) /* enqueued loads land first */
        if (j->dir == KVO_LOAD && !kvo_flag_reached(&e->flags, kvo_word_done(KVO_LOAD), j->seq))
            return;
    uint32_t top = 0; /* the newest released: the queue runs in sequence order */
    kvo_job *cur = e->current[KVO_LOAD];
    if (cur != NULL && !cur->released) {
        __atomic_store_n(&cur->released, 1, __ATOMIC_RELEASE);
        top = cur->seq;
    }
    for (kvo_job *j = e->queue_head[KVO_LOAD]; j != NULL; j = j->next) {
        if (j->released) continue;
        __atomic_store_n(&j->released, 1, __ATOMIC_RELEASE);
        top = j->seq;
    }
    if (top == 0) return;
    for (int64_t l = 0; l < e->flags.layers; l++)
        kvo_flag_set(&e->flags, kvo_word_layer(&e->flags, l), top);
    e->released++;
    pthread_cond_broadcast(&e->changed);
}

/* 1 finished (0 ok or a device error code in *code), 0 still running. */
static int check(kvo_core *e, kvo_job *j, double now, int *code) {
    *code = 0;
    if (kvo_flag_reached(&e->flags, kvo_word_done(j->dir), j->seq)) return 1;
    if (j->done_ev == NULL || now - j->t_enqueued < KVO_ERROR_POLL_S ||
        now - j->t_polled < KVO_ERROR_POLL_S)
        return 0;
    j->t_polled = now;
    int q = e->d.event_query(j->done_ev);
    if (q == 0 || q == KVO_NOT_READY) return 0; /* 0: the flag's write is about to land */
    *code = q;
    return 1;
}

void *kvo_completer(void *p) {
    kvo_core *e = p;
    if (e->ctx) e->d.ctx_set(e->ctx);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* 1 us: short sleeps stay short */
    kvo_job *batch[COMPLETER_BATCH];
    for (;;) {
        pthread_mutex_lock(&e->mu);
        for (;;) {
            kvo_release_stuck(e, kvo_now());
            if (e->inflight != NULL || (e->closing && e->workers_exited)) break;
            if (e->early_n > 0) { /* until the next release time (a released job settling) */
                double at = kvo_next_release(e);
                kvo_timed_wait(e, at > 0 ? at : kvo_now() + 10e-3);
            } else {
                pthread_cond_wait(&e->changed, &e->mu);
            }
        }
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
