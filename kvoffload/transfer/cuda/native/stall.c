/* Stall timers (core.h): how long an engine's stream stood at each layer's wait of a load.
 *
 * A timer holds two timing events per layer. A wait that kvo_job_wait_on enqueues for a layer
 * (one per layer slice; a layer already landed enqueues none and stood 0) is bracketed by them
 * on the engine's stream: the start event completes when the stream reaches the wait, the end
 * event when the wait releases it, so their interval is the stall. Two driver calls per timed
 * wait, in the waiting thread, where the engine would otherwise time the wait itself (two
 * events through its framework's Python, ~25-40 us a layer in bench e2e, docs/e2e.md). */
#include <stdlib.h>

#include "core_state.h"

#define NOT_READY 600 /* CUDA_ERROR_NOT_READY */

enum { UNTIMED, STARTED, TIMED };

struct kvo_timer {
    int64_t n;
    kvo_event *start, *end;
    unsigned char *state;
    double own_s; /* host seconds of its records since the last reset (kvo_timer_own_s) */
};

void kvo_timer_free(kvo_core *e, kvo_timer *t) {
    if (t == NULL) return;
    void *prev = kvo_ctx_enter(e);
    for (int64_t i = 0; i < t->n; i++) {
        if (t->start != NULL && t->start[i] != NULL) e->d.event_destroy(t->start[i]);
        if (t->end != NULL && t->end[i] != NULL) e->d.event_destroy(t->end[i]);
    }
    kvo_ctx_leave(e, prev);
    free(t->start);
    free(t->end);
    free(t->state);
    free(t);
}

kvo_status kvo_timer_create(kvo_core *e, int64_t layers, kvo_timer **out, char *msg) {
    *out = NULL;
    if (layers < 1 || layers > e->spec.max_layers)
        return kvo_say(msg, KVO_REFUSED, "expected 1 <= layers <= %lld (the layout's), got %lld",
                       (long long)e->spec.max_layers, (long long)layers);
    if (e->d.elapsed == NULL)
        return kvo_say(msg, KVO_FAILED, "expected cuEventElapsedTime in the CUDA driver, it has none");
    kvo_timer *t = calloc(1, sizeof *t);
    if (t == NULL) return kvo_say(msg, KVO_FAILED, "out of host memory (a stall timer)");
    t->start = calloc((size_t)layers, sizeof *t->start);
    t->end = calloc((size_t)layers, sizeof *t->end);
    t->state = calloc((size_t)layers, 1);
    if (t->start == NULL || t->end == NULL || t->state == NULL) {
        kvo_timer_free(e, t);
        return kvo_say(msg, KVO_FAILED, "out of host memory (a stall timer)");
    }
    void *prev = kvo_ctx_enter(e);
    int err = 0;
    for (t->n = 0; t->n < layers && !err; t->n++) { /* flags 0: timing events */
        err = e->d.event_create(&t->start[t->n], 0);
        if (!err) err = e->d.event_create(&t->end[t->n], 0);
    }
    kvo_ctx_leave(e, prev);
    if (err) {
        kvo_timer_free(e, t);
        return kvo_say(msg, KVO_FAILED, "cuEventCreate failed: %s", kvo_error_name(&e->d, err));
    }
    *out = t;
    return KVO_OK;
}

int64_t kvo_timer_layers(const kvo_timer *t) { return t->n; }

void kvo_timer_reset(kvo_timer *t) {
    for (int64_t i = 0; i < t->n; i++) t->state[i] = UNTIMED;
    t->own_s = 0.0;
}

double kvo_timer_own_s(const kvo_timer *t) { return t->own_s; }

int kvo_timer_begin(kvo_core *e, kvo_timer *t, int64_t layer, kvo_stream stream) {
    if (layer < 0 || layer >= t->n) return 0;
    if (t->state[layer] == TIMED) return 1; /* an earlier job's wait at this layer: keep its start */
    double t0 = kvo_now();
    int err = e->d.record(t->start[layer], stream);
    t->own_s += kvo_now() - t0;
    if (err) return 0;
    t->state[layer] = STARTED;
    return 1;
}

void kvo_timer_end(kvo_core *e, kvo_timer *t, int64_t layer, kvo_stream stream, int ok) {
    if (ok) { /* an end not recorded would leave an earlier one, before this wait: untimed */
        double t0 = kvo_now();
        t->state[layer] = e->d.record(t->end[layer], stream) == 0 ? TIMED : UNTIMED;
        t->own_s += kvo_now() - t0;
    } else if (t->state[layer] == STARTED) /* no wait enqueued (an earlier job's stays timed) */
        t->state[layer] = UNTIMED;
}

kvo_status kvo_timer_read(kvo_core *e, kvo_timer *t, double *out, char *msg) {
    kvo_status rc = KVO_OK;
    void *prev = kvo_ctx_enter(e);
    for (int64_t i = 0; i < t->n && rc == KVO_OK; i++) {
        out[i] = 0.0;
        if (t->state[i] != TIMED) continue;
        int err = e->d.event_query(t->end[i]);
        if (err == NOT_READY) {
            out[i] = -1.0;
            continue;
        }
        float ms = 0.0f;
        if (!err) err = e->d.elapsed(&ms, t->start[i], t->end[i]);
        if (err)
            rc = kvo_say(msg, KVO_FAILED, "layer %lld's stall: %s", (long long)i,
                         kvo_error_name(&e->d, err));
        out[i] = ms > 0 ? ms / 1e3 : 0.0;
    }
    kvo_ctx_leave(e, prev);
    return rc;
}
