/* Can a load's enqueue be one CUDA graph launch instead of one driver call per copy? (issue 25)
 *
 * Built and run by graph_enqueue_probe.py on a CUDA machine (cc, the toolkit's cuda.h, the
 * driver's stub library). One "load" is S slices, each R host-to-device copies (one per run of
 * host slots), one kernel launch (the scatter) and one flag write (cuStreamWriteValue32), as the
 * native core enqueues a layered load. Arms, host time of one load's enqueue:
 *   direct1d   the calls themselves, 1D copies (cuMemcpyHtoDAsync)
 *   direct2d   the same with 2D copies (cuMemcpy2DAsync: a run of slots, one slice's rows)
 *   launch     the same work captured once as a graph, then cuGraphLaunch only (the floor: no
 *              parameter changes, which a real load needs)
 *   update     that graph's copy sources, kernel arguments and flag values changed per load
 *              (cuGraphExec*NodeSetParams, each node), then cuGraphLaunch
 * and, per arm, a launch-bound loop (LOOP_KERNELS empty kernels on another stream, another
 * thread, no Python) timed alone and beside the arm's enqueue repeated back to back: what an
 * engine's launches feel of each way of enqueueing.
 *
 * Usage: probe SLICES RUNS ITERS COPY_BYTES [FLAGS]; FLAGS 0 leaves the flag writes out (where
 * a graph cannot capture them). Prints one JSON object per arm. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                                         \
    do {                                                                                    \
        CUresult r_ = (call);                                                               \
        if (r_ != CUDA_SUCCESS) {                                                           \
            const char *n_ = "?";                                                           \
            cuGetErrorName(r_, &n_);                                                        \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, n_);       \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

#define LOOP_KERNELS 2000
#define LOOP_REPS 9
#define MAX_NODES 4096

static const char *PTX =
    ".version 7.8\n.target sm_90\n.address_size 64\n"
    ".visible .entry k(.param .u64 a, .param .u64 b, .param .u64 c, .param .u64 d)\n{\n ret;\n}\n";

static int S, R, ITERS, FLAGS = 1;
static size_t B;
static CUcontext ctx;
static CUfunction fn;
static CUstream st, loop_st;
static char *host;      /* 3 * S * R * B pinned: a load reads a third of it, alternating */
static CUdeviceptr dst; /* S * R * B */
static CUdeviceptr flag;
static unsigned long long kargs[4];
static void *kparams[4] = {&kargs[0], &kargs[1], &kargs[2], &kargs[3]};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static size_t src_at(int it, int s, int r) { return ((size_t)(it & 1) * S * R + s * R + r) * B; }

static void direct(int it, int two_d) {
    for (int s = 0; s < S; s++) {
        for (int r = 0; r < R; r++) {
            size_t at = (size_t)(s * R + r) * B;
            if (two_d) { /* the run's rows: 4 slots of B / 4 bytes, slot pitch B / 2 */
                CUDA_MEMCPY2D p;
                memset(&p, 0, sizeof p);
                p.srcMemoryType = CU_MEMORYTYPE_HOST;
                p.srcHost = host + src_at(it, s, r) / 2;
                p.srcPitch = B / 2;
                p.dstMemoryType = CU_MEMORYTYPE_DEVICE;
                p.dstDevice = dst + at;
                p.dstPitch = B / 4;
                p.WidthInBytes = B / 4;
                p.Height = 4;
                CHECK(cuMemcpy2DAsync(&p, st));
            } else {
                CHECK(cuMemcpyHtoDAsync(dst + at, host + src_at(it, s, r), B, st));
            }
        }
        kargs[0] = dst, kargs[1] = (unsigned long long)it, kargs[2] = s, kargs[3] = R;
        CHECK(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, st, kparams, NULL));
        if (FLAGS) CHECK(cuStreamWriteValue32(st, flag, (cuuint32_t)it, 0));
    }
}

static CUgraphExec exec;
static CUgraphNode nodes[MAX_NODES];
static CUgraphNodeType types[MAX_NODES];
static size_t n_nodes;
static CUDA_MEMCPY3D copies[MAX_NODES];
static CUDA_KERNEL_NODE_PARAMS kernels[MAX_NODES];
static CUDA_BATCH_MEM_OP_NODE_PARAMS memops[MAX_NODES];
static CUstreamBatchMemOpParams ops[MAX_NODES];

static void build_graph(void) {
    CUgraph g;
    CHECK(cuStreamBeginCapture(st, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    direct(0, 0);
    CHECK(cuStreamEndCapture(st, &g));
    CHECK(cuGraphInstantiate(&exec, g, 0));
    CHECK(cuGraphUpload(exec, st));
    CHECK(cuStreamSynchronize(st));
    n_nodes = MAX_NODES;
    CHECK(cuGraphGetNodes(g, nodes, &n_nodes));
    for (size_t i = 0; i < n_nodes; i++) {
        CHECK(cuGraphNodeGetType(nodes[i], &types[i]));
        if (types[i] == CU_GRAPH_NODE_TYPE_MEMCPY) CHECK(cuGraphMemcpyNodeGetParams(nodes[i], &copies[i]));
        if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL) CHECK(cuGraphKernelNodeGetParams(nodes[i], &kernels[i]));
        if (types[i] == CU_GRAPH_NODE_TYPE_BATCH_MEM_OP) {
            CHECK(cuGraphBatchMemOpNodeGetParams(nodes[i], &memops[i]));
            if (memops[i].count != 1) {
                fprintf(stderr, "expected one operation per memop node, got %u\n", memops[i].count);
                exit(2);
            }
            ops[i] = memops[i].paramArray[0];
            memops[i].paramArray = &ops[i];
        }
    }
}

/* The captured graph's nodes in capture order (one stream: a chain) with this load's values. */
static void update(int it) {
    int copy = 0, slice = 0;
    for (size_t i = 0; i < n_nodes; i++) {
        if (types[i] == CU_GRAPH_NODE_TYPE_MEMCPY) {
            int s = copy / R, r = copy % R;
            if (copies[i].srcMemoryType == CU_MEMORYTYPE_HOST)
                copies[i].srcHost = host + src_at(it, s, r);
            else /* unified addressing: the host pointer is the device address */
                copies[i].srcDevice = (CUdeviceptr)(host + src_at(it, s, r));
            CHECK(cuGraphExecMemcpyNodeSetParams(exec, nodes[i], &copies[i], ctx));
            copy++;
        } else if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL) {
            kargs[0] = dst, kargs[1] = (unsigned long long)it, kargs[2] = slice++, kargs[3] = R;
            kernels[i].kernelParams = kparams;
            CHECK(cuGraphExecKernelNodeSetParams(exec, nodes[i], &kernels[i]));
        } else if (types[i] == CU_GRAPH_NODE_TYPE_BATCH_MEM_OP) {
            ops[i].writeValue.value = (cuuint32_t)it;
            CHECK(cuGraphExecBatchMemOpNodeSetParams(exec, nodes[i], &memops[i]));
        }
    }
}

static void enqueue(const char *arm, int it) {
    if (!strcmp(arm, "direct1d")) direct(it, 0);
    else if (!strcmp(arm, "direct2d")) direct(it, 1);
    else if (!strcmp(arm, "launch")) CHECK(cuGraphLaunch(exec, st));
    else { update(it); CHECK(cuGraphLaunch(exec, st)); }
}

/* The engine's stand-in: LOOP_KERNELS launches on its own stream, timed on the host. */
static double launch_loop(void) {
    CHECK(cuCtxSetCurrent(ctx));
    unsigned long long z[4] = {0, 0, 0, 0};
    void *p[4] = {&z[0], &z[1], &z[2], &z[3]};
    double t0 = now_us();
    for (int i = 0; i < LOOP_KERNELS; i++) CHECK(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, loop_st, p, NULL));
    double t = now_us() - t0;
    CHECK(cuStreamSynchronize(loop_st));
    return t;
}

static volatile int beside_run;
static const char *beside_arm;

static void *beside(void *unused) {
    (void)unused;
    CHECK(cuCtxSetCurrent(ctx));
    for (int it = 2; beside_run; it++) {
        enqueue(beside_arm, it);
        CHECK(cuStreamSynchronize(st));
    }
    return NULL;
}

static int verify(int it) {
    /* the last load's first and last copies landed from this load's sources */
    char *got = malloc(B);
    int ok = 1;
    for (int k = 0; k < 2 && ok; k++) {
        int s = k ? S - 1 : 0, r = k ? R - 1 : 0;
        CHECK(cuMemcpyDtoH(got, dst + (size_t)(s * R + r) * B, B));
        ok = !memcmp(got, host + src_at(it, s, r), B);
    }
    free(got);
    return ok;
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "expected SLICES RUNS ITERS COPY_BYTES [FLAGS], got %d arguments\n",
                argc - 1);
        return 2;
    }
    if (argc == 6) FLAGS = atoi(argv[5]) != 0;
    S = atoi(argv[1]), R = atoi(argv[2]), ITERS = atoi(argv[3]), B = (size_t)atoll(argv[4]);
    if (S < 1 || R < 1 || ITERS < 2 || B < 64 || B % 64 || S * R * 3 + 8 > MAX_NODES) {
        fprintf(stderr, "expected SLICES, RUNS >= 1, ITERS >= 2, COPY_BYTES a multiple of 64, "
                        "got %s %s %s %s\n", argv[1], argv[2], argv[3], argv[4]);
        return 2;
    }
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CUmodule mod;
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&fn, mod, "k"));
    CHECK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&loop_st, CU_STREAM_NON_BLOCKING));
    size_t total = (size_t)S * R * B;
    CHECK(cuMemHostAlloc((void **)&host, 3 * total, 0));
    for (size_t i = 0; i < 3 * total; i++) host[i] = (char)(i * 2654435761u >> 13);
    CHECK(cuMemAlloc(&dst, total));
    void *fh;
    CHECK(cuMemHostAlloc(&fh, 64, CU_MEMHOSTALLOC_DEVICEMAP));
    CHECK(cuMemHostGetDevicePointer(&flag, fh, 0));
    build_graph();

    const char *arms[] = {"direct1d", "direct2d", "launch", "update"};
    double *t = malloc(sizeof(double) * ITERS);
    for (int a = 0; a < 4; a++) {
        for (int it = 0; it < ITERS; it++) {
            double t0 = now_us();
            enqueue(arms[a], it);
            t[it] = now_us() - t0;
            CHECK(cuStreamSynchronize(st));
        }
        int ok = strcmp(arms[a], "direct2d") ? verify(!strcmp(arms[a], "launch") ? 0 : ITERS - 1) : -1;
        qsort(t, ITERS, sizeof(double), cmp);
        double alone[LOOP_REPS], with[LOOP_REPS];
        for (int k = 0; k < LOOP_REPS; k++) {
            alone[k] = launch_loop();
            beside_arm = arms[a], beside_run = 1;
            pthread_t th;
            pthread_create(&th, NULL, beside, NULL);
            with[k] = launch_loop();
            beside_run = 0;
            pthread_join(th, NULL);
        }
        qsort(alone, LOOP_REPS, sizeof(double), cmp);
        qsort(with, LOOP_REPS, sizeof(double), cmp);
        printf("{\"arm\": \"%s\", \"slices\": %d, \"runs\": %d, \"copy_bytes\": %zu, "
               "\"graph_nodes\": %zu, \"enqueue_us_p10\": %.2f, \"enqueue_us_p50\": %.2f, "
               "\"enqueue_us_p90\": %.2f, \"bytes_verified\": %s, \"loop_alone_us\": %.1f, "
               "\"loop_beside_us\": %.1f, \"flag_writes\": %s}\n",
               arms[a], S, R, B, n_nodes, t[ITERS / 10], t[ITERS / 2], t[ITERS * 9 / 10],
               ok < 0 ? "null" : ok ? "true" : "false", alone[LOOP_REPS / 2], with[LOOP_REPS / 2],
               FLAGS ? "true" : "false");
        fflush(stdout);
    }
    free(t);
    return 0;
}
