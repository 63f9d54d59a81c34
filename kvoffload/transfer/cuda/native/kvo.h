/* The native transfer engine: shared declarations.
 *
 * No CUDA and no toolkit headers: the driver's entry points are a table of function pointers
 * (kvo_driver), filled from libcuda.so.1 through cuGetProcAddress at run time (driver.c) or, in
 * the CPU tests, with callbacks that move real bytes. The engine's description arrives as one
 * packed int64 array built by kvoffload/transfer/cuda/engine_spec.py (layout in spec.c).
 */
#ifndef KVO_H
#define KVO_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef void *kvo_stream;
typedef void *kvo_event;
typedef uint64_t kvo_dptr;

/* The driver entry points the engine calls, in this order (Python: native.DRIVER_FIELDS). */
typedef struct {
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                  kvo_stream, void **, void **);                  /* cuLaunchKernel */
    int (*batch)(void *, void *, void *, size_t, void *, void *, size_t, size_t *,
                 kvo_stream);                                     /* cuMemcpyBatchAsync (12.8 ABI) or NULL */
    int (*copy)(kvo_dptr, kvo_dptr, size_t, kvo_stream);          /* cuMemcpyAsync */
    int (*record)(kvo_event, kvo_stream);                         /* cuEventRecord */
    int (*wait)(kvo_stream, kvo_event, unsigned);                 /* cuStreamWaitEvent */
    int (*event_create)(kvo_event *, unsigned);                   /* cuEventCreate */
    int (*event_destroy)(kvo_event);                              /* cuEventDestroy_v2 */
    int (*event_query)(kvo_event);                                /* cuEventQuery */
    int (*event_sync)(kvo_event);                                 /* cuEventSynchronize */
    int (*ctx_get)(void **);                                      /* cuCtxGetCurrent */
    int (*ctx_set)(void *);                                       /* cuCtxSetCurrent */
    int (*mem_alloc)(kvo_dptr *, size_t);                         /* cuMemAlloc_v2 */
    int (*mem_free)(kvo_dptr);                                    /* cuMemFree_v2 */
    int (*host_alloc)(void **, size_t, unsigned);                 /* cuMemHostAlloc */
    int (*host_free)(void *);                                     /* cuMemFreeHost */
    int (*stream_sync)(kvo_stream);                               /* cuStreamSynchronize */
    int (*error_name)(int, const char **);                        /* cuGetErrorName, may be NULL */
} kvo_driver;

#define KVO_DRIVER_FIELDS 17
#define KVO_NOT_READY 600 /* CUDA_ERROR_NOT_READY */
#define KVO_MAX_DMAS 4
#define KVO_INDEX_RING 8  /* device block-id buffers per direction */
#define KVO_HOST_IDS 16   /* jobs of at most this many blocks: the kernels read ids from host */
#define KVO_INDEX_FIRST 4096 /* block ids each index buffer holds from the start */
#define KVO_STORE 0
#define KVO_LOAD 1

/* How C launches one compiled variant of Triton's copy_blocks kernel (kernels.py). */
typedef struct {
    int64_t function; /* CUfunction */
    int64_t grid;     /* programs */
    int64_t block;    /* threads per program */
    int64_t shared;   /* dynamic shared memory bytes */
    int64_t wide;     /* bit j: integer argument j (first, n_blocks, n_regions, host_base,
                         slot_stride) is i64, else i32 */
    int64_t hidden;   /* trailing pointer parameters Triton added, passed as NULL */
} kvo_kernel;

/* What moves of each block in one pass: all regions (a store) or one layer slice (a load). */
typedef struct {
    int64_t offset;    /* bytes into the host slot */
    int64_t unit;      /* bytes per block */
    int64_t regions;   /* device address of the int64 [4, n_regions] region table */
    int64_t n_regions;
} kvo_part;

typedef struct {
    int64_t num_blocks;  /* engine blocks */
    int64_t slot_bytes;  /* bytes of one block of every layer */
    int64_t n_layers;
    int64_t n_parts, n_plans;
    kvo_kernel kernel[2]; /* [store, load] */
    kvo_part *parts;      /* parts[0]: the whole slot; load slices after it */
    int64_t *plan_count;  /* per load schedule: slices */
    int64_t *plan_first;  /* ... its first part */
    int64_t *plan_owner;  /* n_plans x n_layers: the slice holding each layer */
} kvo_group;

typedef struct {
    int64_t n_groups, num_slots, arena_base, arena_slot_bytes;
    int64_t depth, area_bytes, first_chunk_bytes, min_slice_transfer_bytes, n_dmas;
    int64_t max_layers;
    int64_t inline_bytes;              /* jobs up to this size are enqueued by the caller */
    int64_t gather[2];                 /* per direction: the kernels' stream */
    int64_t dmas[2][KVO_MAX_DMAS];     /* per direction: the DMA streams */
    int64_t *bases[2];                 /* per direction: staging area addresses (depth) */
    kvo_group *groups;
} kvo_spec;

/* One direction's staging ring, index buffers and scratch, touched by its worker only. */
typedef struct {
    kvo_event filled[64], freed[64], joins[KVO_MAX_DMAS];
    int64_t position;
    struct { void *host; kvo_dptr dev; int64_t capacity; kvo_event idle; int used; } index[KVO_INDEX_RING];
    int64_t index_pos;
    int64_t *sizes, *starts, *src, *dst, *len; /* scratch: chunk plan and one chunk's descriptors */
    int64_t scratch_chunks, scratch_desc;
} kvo_lane;

enum { KVO_QUEUED = 0, KVO_RUNNING = 1, KVO_INFLIGHT = 2, KVO_DONE = 3 };
enum { STEP_NONE = 0, STEP_LAUNCH = 1, STEP_COPY = 2, STEP_RECORD = 3, STEP_WAIT = 4,
       STEP_ALLOC = 5, STEP_ARG = 6, STEP_QUERY = 7, STEP_CANCEL = 8, STEP_CLOSED = 9 };

typedef struct kvo_job {
    int64_t id;
    int dir;
    int64_t n_specs, total;
    int64_t *group, *count, *at;   /* per spec: group, blocks, offset into ids */
    int64_t *ids;                  /* per spec: its blocks, then its slots */
    int64_t *plan_first, *plan_count; /* per spec (loads): first part, slices */
    int64_t n_slices, n_layers;
    int64_t *layer_slice;          /* per layer (loads): slice index */
    kvo_event order, done_ev, *slices;
    int64_t recorded;              /* slices whose event is recorded */
    int state, failed, cancelled, done_recorded;
    int code, step;
    int64_t chunk, desc;
    char message[400];
    double t_submit, t_start, t_enqueued, t_first_slice, t_done;
    int refs;                      /* the Python Job object, the engine's queues */
    struct kvo_job *next;          /* queue / in-flight list */
} kvo_job;

typedef struct kvo_engine {
    kvo_driver d;
    kvo_spec spec;
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t work[2], changed;
    kvo_job *queue_head[2], *queue_tail[2];
    kvo_job *inflight;             /* enqueued, not finished */
    int running[2];                /* a worker is enqueueing a job */
    int closing, threads_started, workers_exited;
    pthread_t worker[2], completer;
    kvo_lane lane[2];
    kvo_event *pool;               /* free events */
    int64_t pool_n, pool_cap;
    pthread_mutex_t check_mu;      /* the duplicate-check bitmaps */
    uint8_t *seen_slots, *seen_blocks;
    int64_t next_id;
    int64_t *finished;             /* ids finished since the last drain (when tracking) */
    int64_t finished_n, finished_cap;
    int track_finished;
    int64_t submitted, completed, failures, native_parts;
} kvo_engine;

/* driver.c */
const char *kvo_resolve(kvo_driver *d);
const char *kvo_error_name(const kvo_driver *d, int code);
/* spec.c */
const char *kvo_spec_parse(kvo_spec *s, const int64_t *packed, int64_t n);
void kvo_spec_free(kvo_spec *s);
/* pipeline.c: enqueue one job (the worker's whole per-transfer path); 0 or a CUresult */
int kvo_run_job(kvo_engine *e, kvo_job *job);
void kvo_lane_free(kvo_engine *e, kvo_lane *lane);
int kvo_lane_init(kvo_engine *e, int dir);
/* engine.c */
void *kvo_ctx_enter(kvo_engine *e);
void kvo_ctx_leave(kvo_engine *e, void *prev);
const char *kvo_engine_start(kvo_engine *e);
/* One spec of a submit, as the module parsed it (ids borrowed from the caller's arrays). */
typedef struct { int dir; int64_t group, n; const int64_t *blocks, *slots; } kvo_input;
/* Validate every spec (nothing changes on a refusal: 1 and a message in err), then hand a store
 * job and/or a load job to the workers (out[0..*n_out)); -1 and a message for a driver error. */
int kvo_engine_submit(kvo_engine *e, const kvo_input *in, int64_t n_in, kvo_stream order,
                      int has_order, kvo_job **out, int *n_out, char *err, size_t err_len);
void kvo_engine_close(kvo_engine *e);
void kvo_job_release(kvo_engine *e, kvo_job *job);
int kvo_job_wait(kvo_engine *e, kvo_job *job, double timeout); /* 1 finished, 0 timed out */
int kvo_job_wait_slice(kvo_engine *e, kvo_job *job, int64_t k, double timeout);
int kvo_job_cancel(kvo_engine *e, kvo_job *job);
int kvo_fail(kvo_job *job, const kvo_driver *d, int code, int step, int64_t chunk, int64_t desc,
             const char *what);
double kvo_now(void);
kvo_event kvo_event_take(kvo_engine *e, int *err);
void kvo_event_give(kvo_engine *e, kvo_event ev);

#endif
