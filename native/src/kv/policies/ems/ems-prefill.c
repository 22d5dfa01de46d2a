// ems-prefill.c - EMS at the end of a prefill call, one (layer, KV head) list (docs/policies.md#ems).
//
// Window: the last P = min(L_win, n) entries are protected. Candidates (the n - P others)
// are ranked by the mean-pooled (kernel k, zeros counted at the edges) global-local score
// gl = max(a * s_Glo, s_Loc), a = sum(s_Loc) / sum(s_Glo) over the whole list; order: score
// descending, ties -> lower index. The first N_imp = B - P become class centres, the next
// N_tbm = (gamma - 1) * B are "to be merged", the rest are evicted. All redundancies are
// taken against the centres' original keys, before any merge. Each TBM entry, in rank order,
// goes to the centre with the largest R (ties -> lower index) when R >= tau (tau = 1 means
// evict-only), no centre is protected from receiving merges (the paper's PPL setting), and
// the list's total member count stays <= gamma * B (only binding when earlier calls left
// merged entries); otherwise it is evicted (the zero class). Each centre then becomes the
// one-shot weighted merge of itself and its TBM tokens (ems-merge.c, w = this call's s_Loc).
// After the call s_Loc_past = this call's s_Loc and s_Loc_cur = 0 for every entry.
// n <= B: nothing is evicted or merged.
#include "kv/policies/ems/ems.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void ems_partition_free(struct ems_partition *pt) {
    free(pt->order);
    free(pt->best);
    free(pt->r);
    memset(pt, 0, sizeof(*pt));
}

pykv_status ems_partition(const struct ems_opts *o, int32_t B, const struct kv_list *l, struct ems_list *s,
                          const float *loc, struct ems_partition *pt) {
    memset(pt, 0, sizeof(*pt));
    const int32_t n = l->n;
    memcpy(s->lp, loc, (size_t)n * sizeof(float));
    memset(s->lc, 0, (size_t)n * sizeof(float));
    if (n <= B) return PYKV_OK;
    const int32_t P = o->window < n ? o->window : n, nc = n - P;
    pt->nc = nc;
    pt->n_imp = B - P;
    const int64_t tbm_max = (int64_t)(o->gamma - 1) * B;
    pt->n_tbm = (int32_t)(tbm_max < nc - pt->n_imp ? tbm_max : nc - pt->n_imp);
    float *gl = malloc((size_t)nc * 2 * sizeof(float));
    pt->order = malloc((size_t)nc * sizeof(int32_t));
    pt->best = malloc((size_t)(pt->n_tbm ? pt->n_tbm : 1) * sizeof(int32_t));
    pt->r = malloc((size_t)(pt->n_tbm ? pt->n_tbm : 1) * sizeof(float));
    pykv_status st = gl && pt->order && pt->best && pt->r ? PYKV_OK
                   : pykv_error(PYKV_ERR_NOMEM, "ems: out of memory in the prefill eviction");
    if (st == PYKV_OK) {
        ems_global_local(s->glo, loc, n, nc, gl);
        ws_pool1d(gl, nc, o->kernel, WS_POOL_AVG, gl + nc);
        st = ws_rank(gl + nc, nc, pt->order);   // a total order: nested top-k
    }
    free(gl);
    if (st != PYKV_OK) {
        ems_partition_free(pt);
        return st;
    }
    qsort(pt->order, (size_t)pt->n_imp, sizeof(int32_t), cmp_i32);   // the centres, ascending
    for (int32_t t = 0; t < pt->n_tbm; t++) pt->best[t] = -1;
    return PYKV_OK;
}

pykv_status ems_prefill_merge(struct kv_list *l, const struct ems_opts *o, int32_t B, const struct ems_partition *pt,
                              const struct ems_merger *m) {
    const int32_t n = l->n, nc = pt->nc, n_imp = pt->n_imp;
    const int32_t *cent = pt->order;
    int32_t *assign = malloc((size_t)n * sizeof(int32_t));        // centre index (in cent), -1 = none
    int32_t *index_of = malloc((size_t)n * sizeof(int32_t));      // a centre row's index in cent
    int32_t *start = calloc((size_t)n_imp + 1, sizeof(int32_t));  // centre c's sources: src[start[c] ..]
    int32_t *src = malloc((size_t)(pt->n_tbm ? pt->n_tbm : 1) * sizeof(int32_t));
    pykv_status st = assign && index_of && start && src ? PYKV_OK
                   : pykv_error(PYKV_ERR_NOMEM, "ems: out of memory in the prefill eviction");
    if (st == PYKV_OK) {
        for (int32_t j = 0; j < n; j++) assign[j] = -1;
        for (int32_t c = 0; c < n_imp; c++) index_of[cent[c]] = c;
        const int64_t cap = (int64_t)o->gamma * B;
        int64_t members = 0;
        for (int32_t c = 0; c < n_imp; c++) members += ems_members(l, cent[c]);
        for (int32_t j = nc; j < n; j++) members += ems_members(l, j);
        for (int32_t t = 0; t < pt->n_tbm; t++) {   // in rank order, while the member cap allows
            const int32_t i = pt->order[n_imp + t];
            if (pt->best[t] >= 0 && (double)pt->r[t] >= o->tau && members + ems_members(l, i) <= cap) {
                assign[i] = index_of[pt->best[t]];
                members += ems_members(l, i);
                start[assign[i] + 1]++;
            }
        }
        // each centre's sources in ascending order (the order the merge sums them in)
        for (int32_t c = 0; c < n_imp; c++) start[c + 1] += start[c];
        for (int32_t j = 0; j < nc; j++)
            if (assign[j] >= 0) src[start[assign[j]]++] = j;   // start[c] ends at centre c + 1's start
    }
    for (int32_t c = 0, from = 0; c < n_imp && st == PYKV_OK; c++) {
        if (start[c] > from) st = m->merge(m->arg, cent[c], src + from, start[c] - from);
        from = start[c];
    }
    free(assign);
    free(index_of);
    free(start);
    free(src);
    return st;
}

pykv_status ems_prefill_keep(struct kv_cache *cache, struct kv_list *l, struct ems_list *s,
                             const struct ems_partition *pt) {
    int32_t *keep = malloc((size_t)(pt->n_imp + l->n - pt->nc) * sizeof(int32_t) + 1);
    if (!keep) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory in the prefill eviction");
    int32_t nk = 0;   // the centres, then the window
    for (int32_t c = 0; c < pt->n_imp; c++) keep[nk++] = pt->order[c];
    for (int32_t j = pt->nc; j < l->n; j++) keep[nk++] = j;
    ems_list_compact(s, keep, nk);
    const pykv_status st = kv_list_retain(cache, l, keep, nk);
    free(keep);
    return st;
}

struct host_merger {
    const struct policy_event *ev;
    struct kv_list            *l;
    struct ems_list           *s;
};

static pykv_status host_merge(void *arg, int32_t c, const int32_t *src, int32_t n_src) {
    const struct host_merger *h = arg;
    return ems_merge_into(h->ev->cache, h->l, h->s, h->ev->hp->head_dim, c, src, n_src);
}

pykv_status ems_prefill_list(const struct policy_event *ev, const struct ems_opts *o, int32_t B, int32_t g,
                             struct ems_list *s, const float *loc) {
    struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const int32_t d = ev->hp->head_dim;
    struct ems_partition pt;
    PYKV_TRY(ems_partition(o, B, l, s, loc, &pt));
    if (!pt.order) return PYKV_OK;   // n <= B
    if (o->tau < 1.0)   // each TBM entry's most similar centre, by the centres' original keys
        for (int32_t t = 0; t < pt.n_tbm; t++) {
            struct ems_probe probe;
            ems_probe_init(&probe, l, d, pt.order[pt.n_imp + t]);
            for (int32_t c = 0; c < pt.n_imp; c++) {
                const float r = ems_redundancy(l, d, &probe, pt.order[c]);
                if (pt.best[t] < 0 || r > pt.r[t]) {
                    pt.best[t] = pt.order[c];
                    pt.r[t] = r;
                }
            }
        }
    const struct host_merger h = { ev, l, s };
    const struct ems_merger m = { host_merge, (void *)&h };
    pykv_status st = ems_prefill_merge(l, o, B, &pt, &m);
    if (st == PYKV_OK) st = ems_prefill_keep(ev->cache, l, s, &pt);
    ems_partition_free(&pt);
    return st;
}
