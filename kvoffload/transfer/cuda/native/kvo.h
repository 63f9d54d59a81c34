/* The native transfer core: what every file shares (types, the status convention, constants).
 *
 * One owner per concept, one file each: driver.c (the CUDA entry points), spec.c (the core's
 * description), job.c (one transfer's record), flags.c (flag words the GPU writes and waits on),
 * pipeline.c (enqueue one job on its streams), core.c (queues, threads, submit, close) and
 * waits.c (waits, layer gates, what a job reports). module.c only binds core.h to Python.
 */
#ifndef KVO_H
#define KVO_H

#include <stddef.h>
#include <stdint.h>

/* The ABI of the packed spec and of the driver table (Python: kvoffload.transfer.cuda.extension). */
#define KVO_ABI 12

typedef void *kvo_stream;
typedef void *kvo_event;
typedef uint64_t kvo_dptr;

/* Every core entry point returns one of these; a message, where there is one, goes into a
 * caller-owned buffer of KVO_MSG bytes. */
typedef enum {
    KVO_OK = 0,
    KVO_REFUSED = 1, /* bad input: nothing changed (Python: ValueError) */
    KVO_FAILED = 2,  /* a driver call or an allocation failed (RuntimeError) */
    KVO_TIMEOUT = 3, /* a bounded wait ran out (TimeoutError) */
} kvo_status;

#define KVO_MSG 320

#define KVO_STORE 0
#define KVO_LOAD 1
#define KVO_MAX_DMAS 4    /* DMA streams per direction */
#define KVO_MAX_DEPTH 64  /* staging areas per direction */
#define KVO_MAX_GATES 8   /* layer gates per core */
#define KVO_NOT_READY 600 /* CUDA_ERROR_NOT_READY */

/* A spinning thread's pause between looks (a waiter's spin, the completion thread's short waits). */
#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

double kvo_now(void);
/* printf into a KVO_MSG buffer (NULL: nothing); returns status, so `return kvo_say(...)` reads. */
kvo_status kvo_say(char *msg, kvo_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
