/* Flag words: 32-bit counters that the copy streams write (cuStreamWriteValue32 /
 * cuStreamBatchMemOp) and that streams wait on (cuStreamWaitValue32). Numbering: done[2] (per
 * direction, the sequence number of the last job finished), layer[layers] (per layer, the
 * sequence number of the last load whose copy of that layer landed), then gate[gates][layers]
 * (0 closed, 1 open: waits captured in CUDA graphs). Sequence numbers grow by one per job of a
 * direction and compare cyclically, as the driver's GEQ does: (int32_t)(word - target) >= 0.
 *
 * The done and layer words are in pinned, device-mapped host memory: the host reads them with
 * no driver call. The gate words, which only streams read and write, are in device memory: a
 * captured wait on a word in host memory reads it across the link, which a restore's copy keeps
 * busy (benchmarks/gate_graph_probe.py: a wait of a replayed graph +7.6 us beside a 1 GiB
 * host-to-device copy on an H200, +4.8 us on a word in device memory). */
#ifndef KVO_FLAGS_H
#define KVO_FLAGS_H

#include "driver.h"

typedef struct {
    volatile uint32_t *host; /* every word; the gate words' places there stay 0 */
    kvo_dptr dev;            /* the host words as the device sees them */
    kvo_dptr gates_dev;      /* the gate words in device memory (0: no gates) */
    int64_t layers, gates, words;
} kvo_flags;

#define KVO_WAIT_GEQ 0x0 /* CU_STREAM_WAIT_VALUE_GEQ */
#define KVO_WAIT_EQ 0x1  /* CU_STREAM_WAIT_VALUE_EQ */

static inline int64_t kvo_word_done(int dir) { return dir; }
static inline int64_t kvo_word_layer(const kvo_flags *f, int64_t layer) { return 2 + layer; }
static inline int64_t kvo_word_gate(const kvo_flags *f, int64_t gate, int64_t layer) {
    return 2 + f->layers + gate * f->layers + layer;
}

/* 0 or a CUresult. The gate words start closed: zeroed on `stream`, which is then synchronized. */
int kvo_flags_init(kvo_flags *f, const kvo_driver *d, int64_t layers, int64_t gates,
                   kvo_stream stream);
void kvo_flags_free(kvo_flags *f, const kvo_driver *d);
/* Whether word has reached target (cyclic), read on the host. */
int kvo_flag_reached(const kvo_flags *f, int64_t word, uint32_t target);
/* A host write of a done or layer word (after every earlier GPU write it may overtake has
 * landed: the caller's job). */
void kvo_flag_set(kvo_flags *f, int64_t word, uint32_t value);

/* Stream memory operations, gathered and enqueued in as few driver calls as fit. */
#define KVO_OPS_PER_CALL 128
typedef struct {
    uint32_t op, pad0;
    uint64_t address, value;
    uint32_t flags, pad1;
    uint64_t alias, pad2; /* CUstreamBatchMemOpParams: 48 bytes */
} kvo_memop;

typedef struct {
    const kvo_driver *d;
    const kvo_flags *f;
    kvo_stream stream;
    kvo_memop ops[KVO_OPS_PER_CALL];
    int n, err; /* err: the first CUresult; later operations are dropped */
} kvo_ops;

void kvo_ops_begin(kvo_ops *o, const kvo_driver *d, const kvo_flags *f, kvo_stream stream);
void kvo_ops_wait(kvo_ops *o, int64_t word, uint32_t value, unsigned how);
void kvo_ops_write(kvo_ops *o, int64_t word, uint32_t value);
/* Enqueue what is gathered; 0 or the first CUresult. */
int kvo_ops_end(kvo_ops *o);

#endif
