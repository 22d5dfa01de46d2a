// ems-decode.c - EMS at every decode step, one (layer, KV head) list (ALGORITHMS.md 2.8, P4).
//
// The list holds the window (last P = min(L_win, n) entries) and the class centres (the
// rest). The new token has just been appended, so the oldest window token has become a
// centre. While the list is longer than B: the weakest centre by the mean-aligned s_GL
// (s_Loc = s_Loc_past + s_Loc_cur; [decide] no pooling at decode: the centres are not
// adjacent tokens any more; ties -> lower position) is demoted to a TBM token and merged
// into its most similar other centre (R on the stored keys, ties -> lower position) when
// R >= tau (tau = 1: evict only), else evicted. The newest centre takes the freed slot
// (kv_list_drop with the window as tail), so the centres are not in position order after
// a decode step; nothing here depends on their order, and a later prefill's pooling runs
// over the list as it is. [decide] Member cap: the list's total member count
// is kept <= gamma * B by evicting instead of merging when the list is over the cap (a merge
// keeps the count, the new token adds one, an eviction removes the entry's members), rather
// than dropping single member mappings from a look-up table.
#include "ems.h"
#include "../error.h"
#include "../model.h"

#include <stdlib.h>

pykv_status ems_decode_list(const struct policy_event *ev, const struct ems_opts *o, int32_t B, int32_t g,
                            struct ems_list *s) {
    struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const int32_t d = ev->hp->head_dim;
    const int64_t cap = (int64_t)o->gamma * B;
    if (l->n <= B) return PYKV_OK;
    const int32_t n0 = l->n;
    float *loc = malloc((size_t)n0 * 4 * sizeof(float));   // loc, gl, r, tmp
    if (!loc) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory in the decode eviction");
    float *gl = loc + n0, *r = gl + n0, *tmp = r + n0;
    pykv_status st = PYKV_OK;
    while (st == PYKV_OK && l->n > B) {
        const int32_t n = l->n, P = o->window < n ? o->window : n, nc = n - P;
        if (nc < 1) break;
        const float *restrict lp = s->lp, *restrict lc = s->lc;
        for (int32_t j = 0; j < n; j++) loc[j] = lp[j] + lc[j];
        int64_t members = n;
        if (l->n_members)
            for (int32_t j = 0; j < n; j++) members += l->n_members[j] - 1;
        ems_global_local(s->glo, loc, n, nc, gl);
        const int32_t *pos = l->pos;
        int32_t weak = 0;
        for (int32_t j = 1; j < nc; j++)
            if (gl[j] < gl[weak] || (gl[j] == gl[weak] && pos[j] < pos[weak])) weak = j;
        int32_t best = -1;
        if (o->tau < 1.0 && members <= cap && nc > 1) {
            struct ems_probe probe;
            ems_probe_init(&probe, l, d, weak);
            ems_redundancy_all(l, s, d, &probe, nc, r, tmp);
            for (int32_t c = 0; c < nc; c++)
                if (c != weak && (best < 0 || r[c] > r[best] || (r[c] == r[best] && pos[c] < pos[best]))) best = c;
        }
        if (best >= 0 && (double)r[best] >= o->tau) st = ems_merge_into(ev->cache, l, s, d, best, &weak, 1, loc);
        if (st == PYKV_OK) {
            ems_list_drop(s, weak, P);
            st = kv_list_drop(ev->cache, l, weak, P);
        }
    }
    free(loc);
    return st;
}
