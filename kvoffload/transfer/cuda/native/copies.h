/* One chunk's copies between host slots and its staging area (copies.c): the copy-engine half
 * of the staged pipeline, shared by stores and loads. */
#ifndef KVO_COPIES_H
#define KVO_COPIES_H

#include "pipeline.h"

typedef struct {
    const kvo_pipe *p;
    kvo_job *job;
    kvo_lane *lane;         /* its scratch descriptors */
    const int64_t *slots;   /* the chunk's host slots, in order */
    int64_t count;          /* blocks of the chunk */
    int64_t offset, unit;   /* the part: bytes into a slot, bytes per block */
    int64_t base;           /* the staging area's address */
    int whole;              /* whole slots: consecutive slots merge into one descriptor */
    int64_t chunk;          /* the chunk's index (failure reports) */
    int64_t *descs_before;  /* descriptors enqueued before this chunk (failure reports) */
} kvo_chunk;

/* Enqueue the chunk's copies on `stream` (host to staging for a load, staging to host for a
 * store): 0, or the CUresult with the job failed. */
int kvo_copy_chunk(const kvo_chunk *k, kvo_stream stream);

#endif
