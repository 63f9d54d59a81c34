/* One transfer of one direction: what it moves (block and slot ids per spec, a load's layer
 * slices), where it stands, and its first failure. Built by job.c; its lifecycle (states, refs)
 * is the core's (core.c), its enqueue the pipeline's (pipeline.c). */
#ifndef KVO_JOB_H
#define KVO_JOB_H

#include "driver.h"
#include "spec.h"

enum { KVO_QUEUED = 0, KVO_RUNNING = 1, KVO_INFLIGHT = 2, KVO_DONE = 3 };
/* Where a job failed (Python: native.STEP_*). */
enum { STEP_NONE = 0, STEP_LAUNCH = 1, STEP_COPY = 2, STEP_RECORD = 3, STEP_WAIT = 4,
       STEP_ALLOC = 5, STEP_ARG = 6, STEP_QUERY = 7, STEP_CANCEL = 8, STEP_CLOSED = 9,
       STEP_FLAG = 10 };

/* One spec of a submit, as the binding parsed it (ids borrowed from the caller's arrays). */
typedef struct { int dir; int64_t group, n; const int64_t *blocks, *slots; } kvo_input;

typedef struct kvo_job {
    int64_t id;
    int dir;
    int64_t n_specs, total;
    int64_t *group, *count, *at;      /* per spec: group, blocks, offset into ids */
    int64_t *ids;                     /* per spec: its blocks, then its slots */
    int64_t *plan_first, *plan_count; /* per spec (loads): first part, slices */
    int64_t n_slices, n_layers;
    int64_t *layer_slice;             /* per layer (loads): slice index */
    kvo_event order;
    kvo_stream tail;                  /* the stream its end is on (0: none, flags set on the host) */
    uint32_t seq;                     /* the direction's sequence number: flags.h */
    int state, failed, cancelled;
    int64_t marked;                   /* loads: slices whose flag writes are enqueued (atomic) */
    int code, step;
    int64_t chunk, desc;
    char message[KVO_MSG];
    double t_submit, t_start, t_enqueued, t_done, t_polled;
    int refs;                         /* the Python Job object, the core's queues */
    struct kvo_job *next;             /* queue / in-flight list */
} kvo_job;

/* The job of direction dir among in[0..n_in) (NULL: none of that direction, or no memory). */
kvo_job *kvo_job_build(const kvo_spec *s, const kvo_input *in, int64_t n_in, int dir, int *oom);
void kvo_job_free(kvo_job *job); /* its memory; the core gives its events back first */
int64_t kvo_job_bytes(const kvo_job *job, const kvo_spec *s);
/* Record the job's first failure (later ones keep the first message); returns code or 1. */
int kvo_job_fail(kvo_job *job, const kvo_driver *d, int code, int step, int64_t chunk,
                 int64_t desc, const char *what);

#endif
