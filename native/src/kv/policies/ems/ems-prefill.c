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

pykv_status ems_prefill_list(const struct policy_event *ev, const struct ems_opts *o, int32_t B, int32_t g,
                             struct ems_list *s, const float *loc) {
    struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const int32_t n = l->n, d = ev->hp->head_dim;
    const int32_t P = o->window < n ? o->window : n, nc = n - P;
    memcpy(s->lp, loc, (size_t)n * sizeof(float));
    memset(s->lc, 0, (size_t)n * sizeof(float));
    if (n <= B) return PYKV_OK;
    const int32_t n_imp = B - P;
    int64_t tbm_max = (int64_t)(o->gamma - 1) * B;
    const int32_t n_tbm = (int32_t)(tbm_max < nc - n_imp ? tbm_max : nc - n_imp);
    const int64_t cap = (int64_t)o->gamma * B;

    float *gl = malloc((size_t)nc * 2 * sizeof(float));
    int32_t *order = malloc((size_t)nc * sizeof(int32_t));
    int32_t *assign = malloc((size_t)n * sizeof(int32_t));   // centre index, -1 = none
    int32_t *keep = malloc((size_t)n * sizeof(int32_t));
    int32_t *src = malloc((size_t)(n_tbm ? n_tbm : 1) * sizeof(int32_t));
    pykv_status st = (gl && order && assign && keep && src) ? PYKV_OK
                   : pykv_error(PYKV_ERR_NOMEM, "ems: out of memory in the prefill eviction");
    if (st != PYKV_OK) goto done;
    ems_global_local(s->glo, loc, n, nc, gl);
    ws_pool1d(gl, nc, o->kernel, WS_POOL_AVG, gl + nc);
    st = ws_rank(gl + nc, nc, order);   // a total order: nested top-k
    if (st != PYKV_OK) goto done;

    int32_t *cent = order;                       // order[0 .. n_imp): the centres, made ascending
    qsort(cent, (size_t)n_imp, sizeof(int32_t), cmp_i32);
    for (int32_t j = 0; j < n; j++) assign[j] = -1;
    int64_t members = 0;
    for (int32_t c = 0; c < n_imp; c++) members += ems_members(l, cent[c]);
    for (int32_t j = nc; j < n; j++) members += ems_members(l, j);
    if (o->tau < 1.0)
        for (int32_t t = n_imp; t < n_imp + n_tbm; t++) {
            const int32_t i = order[t];
            int32_t best = -1;
            float r_best = 0.0f;
            struct ems_probe probe;
            ems_probe_init(&probe, l, d, i);
            for (int32_t c = 0; c < n_imp; c++) {
                const float r = ems_redundancy(l, d, &probe, cent[c]);
                if (best < 0 || r > r_best) { best = cent[c]; r_best = r; }
            }
            if (best >= 0 && (double)r_best >= o->tau && members + ems_members(l, i) <= cap) {
                assign[i] = best;
                members += ems_members(l, i);
            }
        }
    for (int32_t c = 0; c < n_imp && st == PYKV_OK; c++) {
        int32_t m = 0;
        for (int32_t j = 0; j < nc; j++) if (assign[j] == cent[c]) src[m++] = j;
        if (m > 0) st = ems_merge_into(ev->cache, l, s, d, cent[c], src, m);
    }
    if (st != PYKV_OK) goto done;
    int32_t nk = 0;
    for (int32_t c = 0; c < n_imp; c++) keep[nk++] = cent[c];
    for (int32_t j = nc; j < n; j++) keep[nk++] = j;
    ems_list_compact(s, keep, nk);
    st = kv_list_retain(ev->cache, l, keep, nk);
done:
    free(gl); free(order); free(assign); free(keep); free(src);
    return st;
}
