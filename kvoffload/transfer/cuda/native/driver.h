/* The CUDA driver entry points the core calls: a table of function pointers, filled from
 * libcuda.so.1 through cuGetProcAddress at run time (driver.c) or, in the CPU tests, with callbacks
 * that move real bytes (tests/fake_cuda.py). No CUDA header is needed to build. */
#ifndef KVO_DRIVER_H
#define KVO_DRIVER_H

#include "kvo.h"

/* In this order (Python: native.DRIVER_FIELDS). */
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
    int (*write32)(kvo_stream, kvo_dptr, uint32_t, unsigned);     /* cuStreamWriteValue32 */
    int (*wait32)(kvo_stream, kvo_dptr, uint32_t, unsigned);      /* cuStreamWaitValue32 */
    int (*memops)(kvo_stream, unsigned, void *, unsigned);        /* cuStreamBatchMemOp */
    int (*host_dptr)(kvo_dptr *, void *, unsigned);               /* cuMemHostGetDevicePointer */
    int (*ctx_sync)(void);                                        /* cuCtxSynchronize */
    int (*copy2d)(const void *, kvo_stream);                      /* cuMemcpy2DAsync_v2 */
    int (*elapsed)(float *, kvo_event, kvo_event);                /* cuEventElapsedTime, may be NULL */
    int (*stream_query)(kvo_stream);                              /* cuStreamQuery */
} kvo_driver;

#define KVO_DRIVER_FIELDS 25

/* Resolve libcuda.so.1's entry points into d: KVO_OK, or KVO_FAILED and why in msg. */
kvo_status kvo_resolve(kvo_driver *d, char *msg);
/* The driver's name for a CUresult ("CUresult N" where it has none); valid until the next call
 * in the same thread. */
const char *kvo_error_name(const kvo_driver *d, int code);

#endif
