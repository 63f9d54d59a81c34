/* The staged backend's chunk loop, compiled: one call enqueues every chunk of one transfer part
 * (a store's whole slots, or one layer slice of a load) without the GIL.
 *
 * Plain C99 with no CUDA or Python headers: the driver's entry points (cuLaunchKernel,
 * cuMemcpyBatchAsync at the 12.8 ABI, cuMemcpyAsync, cuEventRecord, cuStreamWaitEvent) arrive as
 * function pointers resolved by kvoffload/transfer/cuda/driver.py, and the copy kernel is the
 * Triton kernel of kernels.py, already compiled and loaded by Triton (its CUfunction). Built at
 * run time by native.py with the system C compiler; where none exists, the backend runs the same
 * loop in Python (staged.py), which this file mirrors step for step.
 *
 * Every struct holds 64-bit fields only, so Python fills them as one numpy int64 array.
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*batch_fn)(void *, void *, void *, size_t, void *, void *, size_t, size_t *, void *);
typedef int (*copy_fn)(uint64_t, uint64_t, size_t, void *);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned);

typedef struct {
    launch_fn launch;
    batch_fn batch; /* NULL: one cuMemcpyAsync per descriptor */
    copy_fn copy;
    record_fn record;
    wait_fn wait;
    void *attrs;      /* one CUmemcpyAttributes for every descriptor */
    void *attr_index; /* size_t[1] = {0} */
} kvo_driver;

typedef struct {
    void *function; /* CUfunction */
    int64_t grid;   /* programs */
    int64_t block;  /* threads per program: 32 * num_warps */
    int64_t shared; /* dynamic shared memory bytes */
    int64_t wide;   /* bit j set: integer argument j (first, n_blocks, n_regions, host_base,
                       slot_stride) is an i64 parameter, else i32 */
    int64_t hidden; /* trailing pointer parameters the compiler added (scratch), passed as NULL */
} kvo_kernel;

typedef struct {
    int64_t store;        /* 1: gather then DMA; 0: DMA then scatter */
    int64_t n_chunks;
    const int64_t *starts; /* per chunk: first block (index into the transfer) */
    const int64_t *counts; /* per chunk: blocks */
    const int64_t *part_at; /* n_chunks + 1: each chunk's first descriptor */
    const int64_t *src;     /* descriptor rows */
    const int64_t *dst;
    const int64_t *size;
    int64_t position; /* staging area of chunk c: (position + c) % depth */
    int64_t depth;
    const int64_t *bases;  /* per area: device address */
    void *const *filled;   /* per area: its data is ready to move on */
    void *const *freed;    /* per area: its data has left */
    void *gather;          /* the kernels' stream */
    void *const *dmas;     /* the DMA streams; chunk c uses dmas[c % n_dmas] */
    int64_t n_dmas;
    int64_t ahead;         /* chunks enqueued in front (see staged.py) */
    uint64_t blocks;       /* device int64 block ids */
    uint64_t regions;      /* device int64 [4, n_regions] region table */
    int64_t n_regions;
    int64_t unit;          /* bytes per block in a staging area */
} kvo_transfer;

enum { STEP_LAUNCH = 1, STEP_COPY = 2, STEP_RECORD = 3, STEP_WAIT = 4 };

/* out: [CUresult, step, chunk, descriptor or -1] of the first failure */
static int fail(int64_t *out, int err, int step, int64_t chunk, int64_t index) {
    out[0] = err;
    out[1] = step;
    out[2] = chunk;
    out[3] = index;
    return err;
}

static int64_t area_of(const kvo_transfer *t, int64_t c) { return (t->position + c) % t->depth; }

static int copies(const kvo_driver *d, const kvo_transfer *t, int64_t c, void *stream,
                  int64_t *out) {
    int64_t a = t->part_at[c], n = t->part_at[c + 1] - a;
    if (n <= 0) return 0;
    if (d->batch == NULL || n == 1) { /* one copy: cuMemcpyAsync costs a third of a batch call */
        for (int64_t i = 0; i < n; i++) {
            int err = d->copy((uint64_t)t->dst[a + i], (uint64_t)t->src[a + i],
                              (size_t)t->size[a + i], stream);
            if (err) return fail(out, err, STEP_COPY, c, a + i);
        }
        return 0;
    }
    size_t index = SIZE_MAX;
    int err = d->batch((void *)(t->dst + a), (void *)(t->src + a), (void *)(t->size + a),
                       (size_t)n, d->attrs, d->attr_index, 1, &index, stream);
    if (err) return fail(out, err, STEP_COPY, c, index < (size_t)n ? a + (int64_t)index : -1);
    return 0;
}

static int launch(const kvo_driver *d, const kvo_kernel *k, const kvo_transfer *t, int64_t c,
                  int64_t *out) {
    int64_t ints[5] = {t->starts[c], t->counts[c], t->n_regions, t->bases[area_of(t, c)],
                       t->unit};
    union {
        int32_t i32;
        int64_t i64;
        uint64_t ptr;
    } arg[8];
    uint64_t none = 0;
    void *params[16];
    arg[0].ptr = t->blocks; /* blocks */
    arg[1].ptr = t->blocks; /* slots: unused, the staging ring is indexed by position */
    arg[2].ptr = t->regions;
    for (int j = 0; j < 5; j++) {
        if (k->wide >> j & 1)
            arg[3 + j].i64 = ints[j];
        else
            arg[3 + j].i32 = (int32_t)ints[j];
    }
    for (int j = 0; j < 8; j++) params[j] = &arg[j];
    for (int j = 8; j < 16; j++) params[j] = &none;
    int err = d->launch(k->function, (unsigned)k->grid, 1, 1, (unsigned)k->block, 1, 1,
                        (unsigned)k->shared, t->gather, params, NULL);
    return err ? fail(out, err, STEP_LAUNCH, c, -1) : 0;
}

#define CHECK(call, step, chunk)                                  \
    do {                                                          \
        int err_ = (call);                                        \
        if (err_) return fail(out, err_, (step), (chunk), -1);    \
    } while (0)

/* A store's chunk: once its area is free, gather into it, mark it filled. */
static int gather(const kvo_driver *d, const kvo_kernel *k, const kvo_transfer *t, int64_t c,
                  int64_t *out) {
    int64_t area = area_of(t, c);
    CHECK(d->wait(t->gather, t->freed[area], 0), STEP_WAIT, c);
    int err = launch(d, k, t, c, out);
    if (err) return err;
    CHECK(d->record(t->filled[area], t->gather), STEP_RECORD, c);
    return 0;
}

/* A load's chunk: once its area is free, DMA the slots into it, mark it filled. */
static int send(const kvo_driver *d, const kvo_transfer *t, int64_t c, int64_t *out) {
    int64_t area = area_of(t, c);
    void *dma = t->dmas[c % t->n_dmas];
    CHECK(d->wait(dma, t->freed[area], 0), STEP_WAIT, c);
    int err = copies(d, t, c, dma, out);
    if (err) return err;
    CHECK(d->record(t->filled[area], dma), STEP_RECORD, c);
    return 0;
}

/* Enqueue every chunk of ``t``; 0, or the first failing call's CUresult (details in ``out``). */
int kvo_staged(const kvo_driver *d, const kvo_kernel *k, const kvo_transfer *t, int64_t *out) {
    int64_t n = t->n_chunks, ahead = t->ahead < n ? t->ahead : n;
    int err;
    if (t->store) {
        for (int64_t c = 0; c < ahead; c++)
            if ((err = gather(d, k, t, c, out))) return err;
        for (int64_t c = 0; c < n; c++) {
            int64_t area = area_of(t, c);
            void *dma = t->dmas[c % t->n_dmas];
            CHECK(d->wait(dma, t->filled[area], 0), STEP_WAIT, c);
            if ((err = copies(d, t, c, dma, out))) return err;
            CHECK(d->record(t->freed[area], dma), STEP_RECORD, c);
            if (c + ahead < n && (err = gather(d, k, t, c + ahead, out))) return err;
        }
    } else {
        for (int64_t c = 0; c < ahead; c++)
            if ((err = send(d, t, c, out))) return err;
        for (int64_t c = 0; c < n; c++) {
            int64_t area = area_of(t, c);
            CHECK(d->wait(t->gather, t->filled[area], 0), STEP_WAIT, c);
            if ((err = launch(d, k, t, c, out))) return err;
            CHECK(d->record(t->freed[area], t->gather), STEP_RECORD, c);
            if (c + ahead < n && (err = send(d, t, c + ahead, out))) return err;
        }
    }
    return 0;
}

/* The ABI this file implements; native.py refuses a library that answers otherwise. */
int kvo_abi(void) { return 1; }
