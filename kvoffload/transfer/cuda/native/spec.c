/* The core's description: one packed int64 array (kvoffload/transfer/cuda/core_spec.py
 * writes it; the field order is CoreSpec.pack's). Parsed once, checked for consistency. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec.h"

#define HEAD 35 /* fields before the staging bases */

typedef struct {
    const int64_t *p;
    int64_t n, at;
} cursor;

static int take(cursor *c, int64_t *out, int64_t count) {
    if (count < 0 || c->at + count > c->n) return -1;
    if (out != NULL) memcpy(out, c->p + c->at, (size_t)count * sizeof(int64_t));
    c->at += count;
    return 0;
}

static int64_t *take_array(cursor *c, int64_t count) {
    int64_t *out = calloc((size_t)(count > 0 ? count : 1), sizeof(int64_t));
    if (out != NULL && take(c, out, count) != 0) {
        free(out);
        return NULL;
    }
    return out;
}

static const char *parse(kvo_spec *s, const int64_t *packed, int64_t n) {
    cursor c = {packed, n, 0};
    int64_t head[HEAD];
    memset(s, 0, sizeof *s);
    if (take(&c, head, HEAD) != 0) return "expected a core spec of at least 35 fields";
    if (head[0] != KVO_ABI) return "expected a core spec of this build's ABI (a stale build)";
    s->n_groups = head[1];
    s->num_slots = head[2];
    s->arena_base = head[3];
    s->arena_slot_bytes = head[4];
    s->depth = head[5];
    s->area_bytes = head[6];
    s->first_chunk_bytes = head[7];
    s->min_slice_transfer_bytes = head[8];
    s->n_dmas = head[9];
    s->gather[KVO_STORE] = head[10];
    s->gather[KVO_LOAD] = head[11];
    for (int j = 0; j < KVO_MAX_DMAS; j++) {
        s->dmas[KVO_STORE][j] = head[12 + j];
        s->dmas[KVO_LOAD][j] = head[16 + j];
    }
    s->inline_bytes = head[20];
    s->gate = head[21];
    s->cost_desc_ns = head[22];
    s->cost_2d_ns = head[23];
    s->cost_chunk_ns = head[24];
    s->cost_slice_ns = head[25];
    s->link_bytes_per_us = head[26];
    s->load_coupled = head[27];
    if (s->load_coupled != 0 && s->load_coupled != 1)
        return "expected load_coupled 0 or 1 in the core spec";
    s->store_coupled = head[28];
    if (s->store_coupled != 0 && s->store_coupled != 1)
        return "expected store_coupled 0 or 1 in the core spec";
    s->exposed_grid = head[29];
    if (s->exposed_grid < 0 || s->exposed_grid > 65535)
        return "expected 0 <= exposed programs <= 65535 in the core spec";
    s->host_ids = head[30];
    s->poll_max_ns = head[31];
    if (s->host_ids < 0 || s->host_ids > (1 << 20) || s->poll_max_ns < 1000 ||
        s->poll_max_ns > 100000000)
        return "expected 0 <= host ids <= 2**20 and 1 us <= completion poll <= 100 ms in the core spec";
    s->max_grid = head[32];
    if (s->max_grid < 1 || s->max_grid > 65535)
        return "expected 1 <= most programs <= 65535 in the core spec";
    s->wait_spin_ns = head[33];
    if (s->wait_spin_ns < 0 || s->wait_spin_ns > 100000000)
        return "expected 0 <= a waiter's spin <= 100 ms in the core spec";
    for (int j = 22; j < 27; j++)
        if (head[j] < 0) return "expected enqueue costs and a link rate >= 0 in the core spec";
    if (s->n_groups < 1 || s->num_slots < 1 || s->arena_slot_bytes < 1 || s->depth < 1 ||
        s->depth > KVO_MAX_DEPTH || s->area_bytes < 1 || s->first_chunk_bytes < 1 ||
        s->min_slice_transfer_bytes < 1 || s->n_dmas < 1 || s->n_dmas > KVO_MAX_DMAS)
        return "expected groups, slots, slot bytes, 1 <= depth <= 64, area bytes, chunk bytes, "
               "slice bytes >= 1 and 1 <= DMA streams <= 4 in the core spec";
    if ((s->load_coupled || s->store_coupled) && s->depth % s->n_dmas != 0)
        return "expected a depth that is a multiple of the DMA streams for coupled chunks";
    s->load_span = head[34];
    if (s->load_span < 1 || s->depth % s->load_span != 0 ||
        (s->load_coupled ? (s->depth / s->load_span) % s->n_dmas != 0 : s->load_span != 1))
        return "expected a load span dividing the depth into a multiple of the DMA streams "
               "(1 for split loads) in the core spec";
    for (int d = 0; d < 2; d++)
        if ((s->bases[d] = take_array(&c, s->depth)) == NULL) return "truncated core spec";
    s->groups = calloc((size_t)s->n_groups, sizeof(kvo_group));
    if (s->groups == NULL) return "out of memory";
    for (int64_t g = 0; g < s->n_groups; g++) {
        kvo_group *gr = &s->groups[g];
        int64_t h[6];
        if (take(&c, h, 6) != 0 || take(&c, (int64_t *)gr->kernel, 12) != 0)
            return "truncated core spec";
        gr->load_program_bytes = h[5];
        gr->num_blocks = h[0];
        gr->slot_bytes = h[1];
        gr->n_layers = h[2];
        gr->n_parts = h[3];
        gr->n_plans = h[4];
        if (gr->num_blocks < 1 || gr->slot_bytes < 1 || gr->slot_bytes > s->arena_slot_bytes ||
            gr->slot_bytes > s->area_bytes || gr->n_layers < 1 || gr->n_parts < 1 ||
            gr->n_plans < 1 || gr->load_program_bytes < 0)
            return "expected a group's blocks, slot bytes (<= host slot and staging area), "
                   "layers, parts and plans >= 1 and load program bytes >= 0";
        gr->parts = (kvo_part *)take_array(&c, 4 * gr->n_parts);
        gr->plan_count = take_array(&c, gr->n_plans);
        gr->plan_first = take_array(&c, gr->n_plans);
        gr->plan_owner = take_array(&c, gr->n_plans * gr->n_layers);
        if (!gr->parts || !gr->plan_count || !gr->plan_first || !gr->plan_owner)
            return "truncated core spec";
        for (int64_t p = 0; p < gr->n_parts; p++) {
            kvo_part *pt = &gr->parts[p];
            if (pt->unit < 1 || pt->offset < 0 || pt->offset + pt->unit > gr->slot_bytes ||
                pt->n_regions < 1)
                return "expected every part inside the group's slot, with regions";
        }
        for (int64_t k = 0; k < gr->n_plans; k++) {
            int64_t cnt = gr->plan_count[k], first = gr->plan_first[k];
            if (cnt < 1 || first < 1 || first + cnt > gr->n_parts)
                return "expected every load schedule's slices among the group's parts";
            for (int64_t l = 0; l < gr->n_layers; l++) {
                int64_t o = gr->plan_owner[k * gr->n_layers + l];
                if (o < 0 || o >= cnt) return "expected each layer's slice inside its schedule";
            }
        }
        if (gr->n_layers > s->max_layers) s->max_layers = gr->n_layers;
    }
    if (c.at != c.n) return "expected no fields after the last group in the core spec";
    return NULL;
}

kvo_status kvo_spec_parse(kvo_spec *s, const int64_t *packed, int64_t n, char *msg) {
    if (n >= 1 && packed[0] != KVO_ABI) {
        memset(s, 0, sizeof *s);
        return kvo_say(msg, KVO_REFUSED, "expected core spec ABI %d, got %lld", KVO_ABI,
                       (long long)packed[0]);
    }
    const char *why = parse(s, packed, n);
    if (why == NULL) return KVO_OK;
    kvo_spec_free(s);
    return kvo_say(msg, KVO_REFUSED, "%s", why);
}

void kvo_spec_free(kvo_spec *s) {
    for (int d = 0; d < 2; d++) free(s->bases[d]);
    if (s->groups != NULL) {
        for (int64_t g = 0; g < s->n_groups; g++) {
            free(s->groups[g].parts);
            free(s->groups[g].plan_count);
            free(s->groups[g].plan_first);
            free(s->groups[g].plan_owner);
        }
        free(s->groups);
    }
    memset(s, 0, sizeof *s);
}
