/* Flag words (flags.h): allocation, host reads and writes, stream memory operations. */
#include <string.h>

#include "flags.h"

#define HOST_ALLOC_PORTABLE 0x01  /* CU_MEMHOSTALLOC_PORTABLE */
#define HOST_ALLOC_DEVICEMAP 0x02 /* CU_MEMHOSTALLOC_DEVICEMAP */
#define OP_WAIT_32 1              /* CU_STREAM_MEM_OP_WAIT_VALUE_32 */
#define OP_WRITE_32 2             /* CU_STREAM_MEM_OP_WRITE_VALUE_32 */

int kvo_flags_init(kvo_flags *f, const kvo_driver *d, int64_t layers, int64_t gates,
                   kvo_stream stream) {
    memset(f, 0, sizeof *f);
    f->layers = layers;
    f->gates = gates;
    f->words = 2 + layers + gates * layers;
    void *host = NULL;
    size_t bytes = (size_t)f->words * sizeof(uint32_t);
    int err = d->host_alloc(&host, bytes, HOST_ALLOC_PORTABLE | HOST_ALLOC_DEVICEMAP);
    if (err) return err;
    memset(host, 0, bytes);
    f->host = host;
    err = d->host_dptr(&f->dev, host, 0);
    size_t gate_bytes = (size_t)(gates * layers) * sizeof(uint32_t);
    if (!err && gate_bytes > 0) err = d->mem_alloc(&f->gates_dev, gate_bytes);
    if (!err && gate_bytes > 0) /* from the host words' zeros at the gates' places */
        err = d->copy(f->gates_dev, f->dev + (kvo_dptr)(2 + layers) * sizeof(uint32_t),
                      gate_bytes, stream);
    if (!err && gate_bytes > 0) err = d->stream_sync(stream);
    if (err) kvo_flags_free(f, d);
    return err;
}

void kvo_flags_free(kvo_flags *f, const kvo_driver *d) {
    if (f->gates_dev) d->mem_free(f->gates_dev);
    if (f->host != NULL) d->host_free((void *)f->host);
    memset(f, 0, sizeof *f);
}

int kvo_flag_reached(const kvo_flags *f, int64_t word, uint32_t target) {
    uint32_t now = __atomic_load_n(&f->host[word], __ATOMIC_ACQUIRE);
    return (int32_t)(now - target) >= 0;
}

void kvo_flag_set(kvo_flags *f, int64_t word, uint32_t value) {
    __atomic_store_n(&f->host[word], value, __ATOMIC_SEQ_CST);
}

void kvo_ops_begin(kvo_ops *o, const kvo_driver *d, const kvo_flags *f, kvo_stream stream) {
    o->d = d;
    o->f = f;
    o->stream = stream;
    o->n = 0;
    o->err = 0;
}

static void flush(kvo_ops *o) {
    if (o->n == 0 || o->err) return;
    if (o->n == 1 && o->ops[0].op == OP_WRITE_32) /* one write: the plain entry point */
        o->err = o->d->write32(o->stream, o->ops[0].address, (uint32_t)o->ops[0].value, 0);
    else if (o->n == 1)
        o->err = o->d->wait32(o->stream, o->ops[0].address, (uint32_t)o->ops[0].value,
                              o->ops[0].flags);
    else
        o->err = o->d->memops(o->stream, (unsigned)o->n, o->ops, 0);
    o->n = 0;
}

static void add(kvo_ops *o, uint32_t op, int64_t word, uint32_t value, unsigned how) {
    if (o->n == KVO_OPS_PER_CALL) flush(o);
    kvo_memop *m = &o->ops[o->n++];
    memset(m, 0, sizeof *m);
    m->op = op;
    int64_t gate = word - 2 - o->f->layers; /* >= 0: a gate word, in device memory */
    m->address = gate >= 0 ? o->f->gates_dev + (uint64_t)gate * sizeof(uint32_t)
                           : o->f->dev + (uint64_t)word * sizeof(uint32_t);
    m->value = value;
    m->flags = how;
}

void kvo_ops_wait(kvo_ops *o, int64_t word, uint32_t value, unsigned how) {
    add(o, OP_WAIT_32, word, value, how);
}

void kvo_ops_write(kvo_ops *o, int64_t word, uint32_t value) { add(o, OP_WRITE_32, word, value, 0); }

int kvo_ops_end(kvo_ops *o) {
    flush(o);
    return o->err;
}
