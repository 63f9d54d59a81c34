/* One chunk's copies (copies.h). A store's whole slots go as copy-engine descriptors,
 * consecutive slots merged, in one cuMemcpyBatchAsync; a load's layer slice (part of each slot)
 * goes as pitched runs of consecutive slots and single pieces: one cuMemcpy3DBatchAsync for
 * the chunk where the driver has it, else one cuMemcpy2DAsync per run and one batch for the
 * singles. */
#include <stdlib.h>
#include <string.h>

#include "copies.h"

/* CUmemcpyAttributes: source read in stream order (the copies wait for the work enqueued ahead
 * of them on the stream; that is how a store's DMA waits for its gather). */
static struct { int order; int src_type, src_id, dst_type, dst_id; unsigned flags; } attrs = {
    1, 0, 0, 0, 0, 0};
static size_t attr_index[1] = {0};

/* CUDA_MEMCPY2D: one pitched copy (a run of consecutive host slots' slices into staging). */
typedef struct {
    size_t src_x, src_y;
    int src_type, pad0;
    const void *src_host;
    uint64_t src_dev;
    void *src_array;
    size_t src_pitch;
    size_t dst_x, dst_y;
    int dst_type, pad1;
    void *dst_host;
    uint64_t dst_dev;
    void *dst_array;
    size_t dst_pitch;
    size_t width, height;
} memcpy2d;

#define MEMORY_UNIFIED 4 /* CU_MEMORYTYPE_UNIFIED: an address of either side (UVA) */
#define RUN_2D 2         /* runs of at least this many consecutive slots go as one 2D copy */

/* Consecutive slots of a part that is not the whole slot (a load's layer slice) are a pitched
 * run in host memory: one 2D copy moves the run (measured: ~0.9 us of host time per
 * cuMemcpyBatchAsync descriptor, so a 1,000-block load of 16 slices took 15 ms to enqueue). */
static int run_2d(const kvo_chunk *k, int64_t host, int64_t staged, int64_t rows,
                  kvo_stream stream) {
    const kvo_pipe *p = k->p;
    int64_t unit = k->unit;
    int store = k->job->dir == KVO_STORE;
    memcpy2d m;
    memset(&m, 0, sizeof m);
    m.src_type = m.dst_type = MEMORY_UNIFIED;
    m.src_dev = (uint64_t)(store ? staged : host);
    m.src_pitch = (size_t)(store ? unit : p->spec->arena_slot_bytes);
    m.dst_dev = (uint64_t)(store ? host : staged);
    m.dst_pitch = (size_t)(store ? p->spec->arena_slot_bytes : unit);
    m.width = (size_t)unit;
    m.height = (size_t)rows;
    int err = p->d->copy2d(&m, stream);
    return err ? kvo_job_fail(k->job, p->d, err, STEP_COPY, k->chunk, *k->descs_before, NULL) : 0;
}

/* CUDA_MEMCPY3D_BATCH_OP (CUDA 12.8): a pointer-to-pointer copy of `height` rows of `width`
 * bytes, rows `row` bytes apart on each side (rowLength in elements of one byte). */
typedef struct {
    int type, pad; /* CU_MEMCPY_OPERAND_TYPE_POINTER */
    uint64_t ptr;
    size_t row_length, layer_height;
    int loc_type, loc_id; /* CUmemLocation hint: unused for pinned and device memory */
} operand3d;
typedef struct {
    operand3d src, dst;
    size_t width, height, depth;
    int src_access_order; /* CU_MEMCPY_SRC_ACCESS_ORDER_STREAM */
    unsigned flags;
} batch_op3d;
_Static_assert(sizeof(operand3d) == 40, "CUmemcpy3DOperand is 40 bytes");
_Static_assert(sizeof(batch_op3d) == 112, "CUDA_MEMCPY3D_BATCH_OP is 112 bytes");

#define OPERAND_POINTER 1
#define ORDER_STREAM 1

/* A load slice's chunk in one call: each run of consecutive slots is one pitched operation (its
 * rows the slots' slices, `arena_slot_bytes` apart in host memory, `unit` apart in staging),
 * each single slot one row. cuMemcpy2DAsync per run cost ~3 us of host time on the H100, so a
 * slice of a prefix stored at several times (several runs) cost a call per run. One operation
 * alone keeps the cheaper single call (cuMemcpy2DAsync or cuMemcpyAsync). */
static int copies_3d(const kvo_chunk *k, kvo_stream stream) {
    const kvo_pipe *p = k->p;
    kvo_job *job = k->job;
    kvo_lane *lane = k->lane;
    const kvo_spec *s = p->spec;
    int64_t count = k->count, unit = k->unit, base = k->base, n = 0;
    int store = job->dir == KVO_STORE;
    if (lane->scratch_ops3d < count) {
        void *q = realloc(lane->ops3d, (size_t)count * sizeof(batch_op3d));
        if (q == NULL)
            return kvo_job_fail(job, p->d, 2, STEP_ALLOC, k->chunk, -1, "out of host memory (copies)");
        lane->ops3d = q;
        lane->scratch_ops3d = count;
    }
    batch_op3d *ops = lane->ops3d;
    const int64_t *slots = k->slots;
    for (int64_t i = 0; i < count;) {
        int64_t run = 1;
        while (i + run < count && slots[i + run] == slots[i] + run) run++;
        int64_t host = s->arena_base + slots[i] * s->arena_slot_bytes + k->offset;
        int64_t staged = base + i * unit;
        batch_op3d *op = &ops[n++];
        memset(op, 0, sizeof *op);
        op->src.type = op->dst.type = OPERAND_POINTER;
        op->src.ptr = (uint64_t)(store ? staged : host);
        op->src.row_length = (size_t)(store ? unit : s->arena_slot_bytes);
        op->dst.ptr = (uint64_t)(store ? host : staged);
        op->dst.row_length = (size_t)(store ? s->arena_slot_bytes : unit);
        op->width = (size_t)unit;
        op->height = (size_t)run;
        op->depth = 1;
        op->src_access_order = ORDER_STREAM;
        i += run;
    }
    if (n == 1 && ops[0].height >= RUN_2D) {
        int64_t host = (int64_t)(store ? ops[0].dst.ptr : ops[0].src.ptr);
        int err = run_2d(k, host, base, (int64_t)ops[0].height, stream);
        if (!err) (*k->descs_before)++;
        return err;
    }
    if (n == 1) {
        int err = p->d->copy((kvo_dptr)ops[0].dst.ptr, (kvo_dptr)ops[0].src.ptr, (size_t)unit, stream);
        if (err) return kvo_job_fail(job, p->d, err, STEP_COPY, k->chunk, *k->descs_before, NULL);
        (*k->descs_before)++;
        return 0;
    }
    size_t fail = SIZE_MAX;
    int err = p->d->batch3d((size_t)n, ops, &fail, 0, stream);
    if (err)
        return kvo_job_fail(job, p->d, err, STEP_COPY, k->chunk,
                            fail < (size_t)n ? *k->descs_before + (int64_t)fail : -1, NULL);
    *k->descs_before += n;
    return 0;
}

int kvo_copy_chunk(const kvo_chunk *k, kvo_stream stream) {
    const kvo_pipe *p = k->p;
    kvo_job *job = k->job;
    kvo_lane *lane = k->lane;
    const kvo_spec *s = p->spec;
    if (!k->whole && s->copy_batch_3d && p->d->batch3d != NULL) return copies_3d(k, stream);
    int64_t count = k->count, unit = k->unit, base = k->base, n = 0;
    int store = job->dir == KVO_STORE;
    for (int64_t i = 0; i < count; i++) {
        const int64_t *slots = k->slots;
        int64_t host = s->arena_base + slots[i] * s->arena_slot_bytes + k->offset;
        int64_t staged = base + i * unit;
        if (k->whole && n > 0 && slots[i] == slots[i - 1] + 1) {
            lane->len[n - 1] += unit;
            continue;
        }
        int64_t run = 1;
        while (!k->whole && i + run < count && slots[i + run] == slots[i] + run) run++;
        if (run >= RUN_2D) {
            int err = run_2d(k, host, staged, run, stream);
            if (err) return err;
            (*k->descs_before)++;
            i += run - 1;
            continue;
        }
        lane->src[n] = store ? staged : host;
        lane->dst[n] = store ? host : staged;
        lane->len[n] = unit;
        n++;
    }
    if (n == 0) return 0;
    if (p->d->batch == NULL || n == 1) { /* one copy: cuMemcpyAsync costs a third of a batch */
        for (int64_t i = 0; i < n; i++) {
            int err = p->d->copy((kvo_dptr)lane->dst[i], (kvo_dptr)lane->src[i],
                                (size_t)lane->len[i], stream);
            if (err)
                return kvo_job_fail(job, p->d, err, STEP_COPY, k->chunk, *k->descs_before + i, NULL);
        }
    } else {
        size_t fail = SIZE_MAX;
        int err = p->d->batch(lane->dst, lane->src, lane->len, (size_t)n, &attrs, attr_index, 1,
                             &fail, stream);
        if (err)
            return kvo_job_fail(job, p->d, err, STEP_COPY, k->chunk,
                            fail < (size_t)n ? *k->descs_before + (int64_t)fail : -1, NULL);
    }
    *k->descs_before += n;
    return 0;
}

