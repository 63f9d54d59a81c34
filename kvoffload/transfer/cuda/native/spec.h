/* The core's description: one packed int64 array written by
 * kvoffload/transfer/cuda/core_spec.py (CoreSpec.pack), parsed once by spec.c. */
#ifndef KVO_SPEC_H
#define KVO_SPEC_H

#include "kvo.h"

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
    /* > 0: a load chunk's scatter runs on one program per this many of its bytes, at least its
     * kernel's own count and at most max_grid: short programs on many SMs for a large slice,
     * few for a small load (pipeline.c, launch_on); 0: the kernel's own count. */
    int64_t load_program_bytes;
} kvo_group;

typedef struct {
    int64_t n_groups, num_slots, arena_base, arena_slot_bytes;
    int64_t depth, area_bytes, first_chunk_bytes, min_slice_transfer_bytes, n_dmas;
    int64_t max_layers;
    int64_t inline_bytes;              /* jobs up to this size are enqueued by the caller */
    int64_t gather[2];                 /* per direction: the kernels' stream */
    int64_t dmas[2][KVO_MAX_DMAS];     /* per direction: the DMA streams */
    int64_t gate;                      /* the stream that opens layer gates */
    /* A load's slice count weighs the caller's enqueue time against the first slice's wire
     * time (job.c, plan_load): host ns per batch descriptor, per 2D copy, per chunk (its events
     * and kernel launch) and per slice (its flag writes), and the link's bytes per us; a link of
     * 0 keeps the byte rule alone. */
    int64_t cost_desc_ns, cost_2d_ns, cost_chunk_ns, cost_slice_ns, link_bytes_per_us;
    /* 1: a load's chunk is copied and scattered on one DMA stream, the one of its staging area
     * (area % n_dmas; depth is a multiple of n_dmas), with no event between them (pipeline.c,
     * "coupled loads"); 0: DMA on the DMA streams, scatter on the kernels' stream. */
    int64_t load_coupled;
    /* > 0: the kernel of a job's exposed chunk (a store's first, a load's last: no copy of the
     * job runs beside it) runs on at least this many programs (pipeline.c, launch_on); 0: on its
     * kernel's own count. The kernel strides over its pieces by its program count, so any count
     * moves the same bytes. */
    int64_t exposed_grid;
    /* jobs of at most this many blocks: the kernels read the block ids from pinned host memory;
     * larger ones upload them with one copy first (lane.c) */
    int64_t host_ids;
    /* the completion thread's longest pause between two reads of the done words (core.c) */
    int64_t poll_max_ns;
    /* 1: a store's chunk is gathered and copied out on one DMA stream, its staging area's
     * (pipeline.c, "coupled stores"); 0: gathered on the kernels' stream, copied after an event. */
    int64_t store_coupled;
    int64_t max_grid; /* the device's SMs: the most programs a load_program_bytes rule gives */
    /* a job's waiter (kvo_job_wait) reads its done word back to back this long before it
     * sleeps between reads (waits.c) */
    int64_t wait_spin_ns;
    /* coupled loads: a chunk's staging is this many consecutive areas (depth / load_span of
     * them, each on DMA stream (area % n_dmas)): a layer slice up to that size is one chunk, so
     * no other stream joins it before its flag words (pipeline.c, "coupled loads"); else 1 */
    int64_t load_span;
    int64_t *bases[2];                 /* per direction: staging area addresses (depth) */
    kvo_group *groups;
} kvo_spec;

/* KVO_OK, or KVO_REFUSED and why in msg (s is then freed already). */
kvo_status kvo_spec_parse(kvo_spec *s, const int64_t *packed, int64_t n, char *msg);
void kvo_spec_free(kvo_spec *s);

#endif
