/* The staged pipeline: enqueue one job on its direction's streams. It knows nothing of the
 * core's threads, queues or lock: the core calls kvo_pipeline_run for one job at a time per
 * direction (the lane is that direction's), from whichever thread enqueues it. */
#ifndef KVO_PIPELINE_H
#define KVO_PIPELINE_H

#include "flags.h"
#include "job.h"

#define KVO_INDEX_RING 32    /* block-id buffers per direction (jobs in flight before reuse waits) */
#define KVO_INDEX_FIRST 4096 /* block ids each index buffer holds from the start */
#define KVO_REUSE_WAIT_S 30.0 /* at most this long for an index buffer still in use */

/* One direction's staging ring, index buffers and scratch. */
typedef struct {
    kvo_event filled[KVO_MAX_DEPTH], freed[KVO_MAX_DEPTH], joins[KVO_MAX_DMAS + 1];
    int64_t position;
    struct {
        void *host;
        kvo_dptr dev;
        int64_t capacity;
        uint32_t seq; /* the last job using it: free once done[dir] reaches it */
    } index[KVO_INDEX_RING];
    int64_t index_pos;
    int64_t *sizes, *starts, *src, *dst, *len; /* scratch: chunk plan and one chunk's descriptors */
    int64_t scratch_chunks, scratch_desc;
    uint32_t seq;  /* the last sequence number given to a job */
    uint32_t prev_seq; /* the job before the running one's (0: none) */
    int64_t parts; /* parts enqueued (stats) */
    unsigned slice_streams; /* coupled loads: bit j, DMA stream j had a chunk of this slice */
    unsigned job_streams;   /* coupled chunks: bit j, DMA stream j had a chunk of this job */
    int job_last;           /* ... and the DMA stream of its latest chunk (a slice's last, once
                             * the slice is enqueued; the job's tail, once the job is) */
    unsigned unordered;     /* coupled loads: bit j, DMA stream j has not yet waited for the
                             * caller's stream and the ids (before its first scatter) */
} kvo_lane;

typedef struct {
    const kvo_driver *d;
    const kvo_spec *spec;
    kvo_flags *flags;
} kvo_pipe;

/* 0 or a CUresult. */
int kvo_lane_init(kvo_lane *lane, const kvo_pipe *p, int dir);
void kvo_lane_free(kvo_lane *lane, const kvo_pipe *p);
/* Give the job its sequence number and enqueue all of it: the wait for the caller's stream, the
 * ids, every chunk, a flag write per load slice (each layer's word), the direction's done word.
 * Returns 0 or the first CUresult (details in the job). Whatever failed, every flag word a wait
 * on this job can name is written in stream order after the job's work (or, where even that
 * cannot be enqueued, on the host once the direction's streams are idle): no wait is left hanging
 * and none is released before the work ahead of it. */
int kvo_pipeline_run(const kvo_pipe *p, kvo_lane *lane, kvo_job *job);
/* lane.c: a buffer of the job's block ids for the kernels (*dev): pinned host memory for at most
 * spec->host_ids ids, else a device buffer filled by one copy on the kernels' stream; 0 or the
 * CUresult (details in the job). */
int kvo_upload_ids(const kvo_pipe *p, kvo_lane *lane, kvo_job *job, kvo_dptr *dev);

#endif
