/* The CUDA driver's entry points, resolved at run time from libcuda.so.1 through
 * cuGetProcAddress (never linked at build time, so the extension builds without a CUDA toolkit
 * and imports on a machine without a GPU). cuMemcpyBatchAsync is asked for at version 12080, the
 * CUDA 12.8 ABI with its failIdx out-parameter (CUDA 13's headers map the name to an entry point
 * without it; 13.x drivers keep serving the 12.8 one); where the driver lacks it the core copies
 * with one cuMemcpyAsync per descriptor. The stream memory operations are required: a driver
 * without them cannot run this core, and the staged backend falls back to dma there. */
#include <dlfcn.h>
#include <stdio.h>

#include "driver.h"

typedef int (*get_proc_fn)(const char *, void **, int, uint64_t, int *);

static void *lookup(get_proc_fn get, const char *name, int version) {
    void *fn = NULL;
    int status = 0;
    if (get(name, &fn, version, 0, &status) != 0 || status != 0) return NULL;
    return fn;
}

kvo_status kvo_resolve(kvo_driver *d, char *msg) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        return kvo_say(msg, KVO_FAILED, "expected the CUDA driver (libcuda.so.1), got: %s",
                       dlerror());
    }
    get_proc_fn get = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    if (get == NULL) {
        return kvo_say(msg, KVO_FAILED, "expected cuGetProcAddress_v2 in libcuda.so.1 (CUDA >= 12)");
    }
    int (*init)(unsigned) = (int (*)(unsigned))lookup(get, "cuInit", 12000);
    if (init == NULL || init(0) != 0) {
        return kvo_say(msg, KVO_FAILED, "cuInit failed: no usable CUDA device or driver");
    }
    struct { void **slot; const char *name; int version; int required; } want[] = {
        {(void **)&d->launch, "cuLaunchKernel", 12000, 1},
        {(void **)&d->batch, "cuMemcpyBatchAsync", 12080, 0},
        {(void **)&d->copy, "cuMemcpyAsync", 12000, 1},
        {(void **)&d->record, "cuEventRecord", 12000, 1},
        {(void **)&d->wait, "cuStreamWaitEvent", 12000, 1},
        {(void **)&d->event_create, "cuEventCreate", 12000, 1},
        {(void **)&d->event_destroy, "cuEventDestroy", 12000, 1},
        {(void **)&d->event_query, "cuEventQuery", 12000, 1},
        {(void **)&d->event_sync, "cuEventSynchronize", 12000, 1},
        {(void **)&d->ctx_get, "cuCtxGetCurrent", 12000, 1},
        {(void **)&d->ctx_set, "cuCtxSetCurrent", 12000, 1},
        {(void **)&d->mem_alloc, "cuMemAlloc", 12000, 1},
        {(void **)&d->mem_free, "cuMemFree", 12000, 1},
        {(void **)&d->host_alloc, "cuMemHostAlloc", 12000, 1},
        {(void **)&d->host_free, "cuMemFreeHost", 12000, 1},
        {(void **)&d->stream_sync, "cuStreamSynchronize", 12000, 1},
        {(void **)&d->error_name, "cuGetErrorName", 12000, 0},
        /* stream memory operations: the core's readiness and completion flags (flags.c) */
        {(void **)&d->write32, "cuStreamWriteValue32", 12000, 1},
        {(void **)&d->wait32, "cuStreamWaitValue32", 12000, 1},
        {(void **)&d->memops, "cuStreamBatchMemOp", 12000, 1},
        {(void **)&d->host_dptr, "cuMemHostGetDevicePointer", 12000, 1},
        {(void **)&d->ctx_sync, "cuCtxSynchronize", 12000, 1},
        {(void **)&d->copy2d, "cuMemcpy2DAsync", 12000, 1},
        /* stall timers only (stall.c): without it they report nothing */
        {(void **)&d->elapsed, "cuEventElapsedTime", 12000, 0},
        /* a job in flight long: whether its tail stream failed on the device (core.c) */
        {(void **)&d->stream_query, "cuStreamQuery", 12000, 1},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        *want[i].slot = lookup(get, want[i].name, want[i].version);
        if (*want[i].slot == NULL && want[i].required) {
            return kvo_say(msg, KVO_FAILED, "expected %s in the CUDA driver, it has none",
                           want[i].name);
        }
    }
    return KVO_OK;
}

const char *kvo_error_name(const kvo_driver *d, int code) {
    static __thread char buf[48];
    const char *name = NULL;
    if (d->error_name != NULL && d->error_name(code, &name) == 0 && name != NULL) return name;
    snprintf(buf, sizeof buf, "CUresult %d", code);
    return buf;
}
