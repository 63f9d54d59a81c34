/* One transfer's record (job.h): built from a submit's specs, its load plan, its failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "job.h"

static const char *STEP_NAMES[] = {"",
                                   "cuLaunchKernel",
                                   "copy",
                                   "cuEventRecord",
                                   "cuStreamWaitEvent",
                                   "allocation",
                                   "kernel argument",
                                   "cuStreamQuery",
                                   "cancel",
                                   "close",
                                   "a flag write"};

int kvo_job_fail(kvo_job *job, const kvo_driver *d, int code, int step, int64_t chunk,
                 int64_t desc, const char *what) {
    if (job->failed) return code ? code : 1;
    job->failed = 1;
    job->code = code;
    job->step = step;
    job->chunk = chunk;
    job->desc = desc;
    int plain = step == STEP_CANCEL || step == STEP_CLOSED || step == STEP_ARG || step == STEP_ALLOC;
    const char *name = plain ? "" : kvo_error_name(d, code);
    char where[80] = "";
    if (chunk >= 0) snprintf(where, sizeof where, " of chunk %lld", (long long)chunk);
    if (step == STEP_COPY && desc >= 0)
        snprintf(job->message, sizeof job->message, "copy%s failed with %s at descriptor %lld",
                 where, name, (long long)desc);
    else
        snprintf(job->message, sizeof job->message, "%s%s failed%s%s%s%s", STEP_NAMES[step], where,
                 *name ? " with " : "", name, what ? ": " : "", what ? what : "");
    return code ? code : 1;
}

int64_t kvo_job_bytes(const kvo_job *job, const kvo_spec *s) {
    int64_t nbytes = 0;
    for (int64_t i = 0; i < job->n_specs; i++)
        nbytes += job->count[i] * s->groups[job->group[i]].slot_bytes;
    return nbytes;
}

/* Host ns to enqueue spec i's slot runs once (one layer slice): a run of >= 2 consecutive slots
 * is one 2D copy, a lone slot one batch descriptor (pipeline.c, copies). */
static int64_t runs_ns(const kvo_spec *s, const int64_t *slots, int64_t n) {
    int64_t ns = 0;
    for (int64_t i = 0; i < n;) {
        int64_t run = 1;
        while (i + run < n && slots[i + run] == slots[i] + run) run++;
        ns += run >= 2 ? s->cost_2d_ns : s->cost_desc_ns;
        i += run;
    }
    return ns;
}

/* Expected ns of plan k for n blocks: the caller's enqueue (per slice: its runs, chunks and flag
 * writes) plus the first slice's wire time, which the engine's first layer waits for. More
 * slices shorten the second and lengthen the first; on scattered slots (a descriptor per block
 * and slice, ~1.35 us each, H100 driver 580) the first grows fastest. */
static int64_t plan_ns(const kvo_spec *s, const kvo_group *g, int64_t k, int64_t n,
                       int64_t once_ns, int64_t nbytes) {
    int64_t count = g->plan_count[k], ns = 0;
    for (int64_t j = 0; j < count; j++) {
        int64_t unit = g->parts[g->plan_first[k] + j].unit;
        int64_t per_chunk = s->area_bytes * s->load_span / unit; /* 1 for split loads */
        int64_t chunks = (n + per_chunk - 1) / per_chunk;
        ns += once_ns + s->cost_slice_ns + chunks * s->cost_chunk_ns;
    }
    return ns + nbytes * 1000 / s->link_bytes_per_us / count;
}

/* The load schedule of each spec: at most one slice per min_slice_transfer_bytes of the job
 * (a later schedule of a tie has smaller slices); among those, the most slices, or with a link
 * rate in the spec, the fewest expected ns (plan_ns). */
static void plan_load(const kvo_spec *s, kvo_job *job) {
    int64_t room = kvo_job_bytes(job, s) / s->min_slice_transfer_bytes;
    if (room < 1) room = 1;
    job->n_slices = 0;
    for (int64_t i = 0; i < job->n_specs; i++) {
        const kvo_group *g = &s->groups[job->group[i]];
        int64_t n = job->count[i], best = -1, best_ns = 0;
        int64_t once_ns = s->link_bytes_per_us ? runs_ns(s, job->ids + job->at[i] + n, n) : 0;
        for (int64_t k = 0; k < g->n_plans; k++) {
            if (g->plan_count[k] > room && g->plan_count[k] != 1) continue;
            if (s->link_bytes_per_us) {
                int64_t ns = plan_ns(s, g, k, n, once_ns, n * g->slot_bytes);
                if (best < 0 || ns < best_ns ||
                    (ns == best_ns && g->plan_count[k] >= g->plan_count[best])) {
                    best = k;
                    best_ns = ns;
                }
            } else if (best < 0 || g->plan_count[k] >= g->plan_count[best]) {
                best = k;
            }
        }
        if (best < 0) best = 0;
        job->plan_first[i] = g->plan_first[best];
        job->plan_count[i] = g->plan_count[best];
        if (job->plan_count[i] > job->n_slices) job->n_slices = job->plan_count[i];
        for (int64_t l = 0; l < g->n_layers; l++) {
            int64_t o = g->plan_owner[best * g->n_layers + l];
            if (o > job->layer_slice[l]) job->layer_slice[l] = o;
        }
    }
}

void kvo_job_free(kvo_job *job) {
    if (job == NULL) return;
    free(job->group);
    free(job->ids);
    free(job->layer_slice);
    free(job);
}

typedef struct { int64_t slot, block; } pair;

static int by_slot(const void *a, const void *b) {
    int64_t x = ((const pair *)a)->slot, y = ((const pair *)b)->slot;
    return (x > y) - (x < y);
}

/* A spec's (block, slot) pairs in ascending slot order (a spec's order carries no meaning: every
 * block of a load's layer slice is ready together). Slots that are consecutive once sorted are a
 * run that moves as one copy per layer slice (pipeline.c, copies), where in the caller's order
 * each could be a descriptor of its own: an engine that evicts a request's blocks tail first
 * stores them in reverse, and the index gives one store call ascending slots, so that prefix's
 * load came back with descending slots, one descriptor per block and slice. Returns -1 out of
 * memory (the pairs stay as given). */
static int sort_by_slot(int64_t *blocks, int64_t *slots, int64_t n) {
    int64_t i = 1;
    while (i < n && slots[i] > slots[i - 1]) i++;
    if (i >= n) return 0;
    pair *t = malloc((size_t)n * sizeof *t);
    if (t == NULL) return -1;
    for (int64_t j = 0; j < n; j++) t[j] = (pair){slots[j], blocks[j]};
    qsort(t, (size_t)n, sizeof *t, by_slot);
    for (int64_t j = 0; j < n; j++) {
        slots[j] = t[j].slot;
        blocks[j] = t[j].block;
    }
    free(t);
    return 0;
}

kvo_job *kvo_job_build(const kvo_spec *s, const kvo_input *in, int64_t n_in, int dir, int *oom) {
    int64_t n_specs = 0, total = 0;
    for (int64_t i = 0; i < n_in; i++)
        if (in[i].dir == dir) {
            n_specs++;
            total += in[i].n;
        }
    if (n_specs == 0) return NULL;
    kvo_job *job = calloc(1, sizeof *job);
    if (job != NULL) {
        job->group = calloc((size_t)(5 * n_specs), sizeof(int64_t));
        job->ids = malloc((size_t)(2 * total + 1) * sizeof(int64_t));
        job->n_layers = dir == KVO_LOAD ? s->max_layers : 0;
        job->layer_slice = calloc((size_t)(job->n_layers + 1), sizeof(int64_t));
    }
    if (job == NULL || !job->group || !job->ids || !job->layer_slice) {
        kvo_job_free(job);
        *oom = 1;
        return NULL;
    }
    job->dir = dir;
    job->n_specs = n_specs;
    job->total = total;
    job->count = job->group + n_specs;
    job->at = job->count + n_specs;
    job->plan_first = job->at + n_specs;
    job->plan_count = job->plan_first + n_specs;
    int64_t k = 0, at = 0;
    for (int64_t i = 0; i < n_in; i++) {
        if (in[i].dir != dir) continue;
        job->group[k] = in[i].group;
        job->count[k] = in[i].n;
        job->at[k] = at;
        memcpy(job->ids + at, in[i].blocks, (size_t)in[i].n * 8);
        memcpy(job->ids + at + in[i].n, in[i].slots, (size_t)in[i].n * 8);
        if (sort_by_slot(job->ids + at, job->ids + at + in[i].n, in[i].n) != 0) {
            kvo_job_free(job);
            *oom = 1;
            return NULL;
        }
        at += 2 * in[i].n;
        k++;
    }
    if (dir == KVO_LOAD) plan_load(s, job);
    return job;
}
