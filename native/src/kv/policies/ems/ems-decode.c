// ems-decode.c - EMS at every decode step, one (layer, KV head) list (docs/policies.md#ems).
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
#include "kv/policies/ems/ems.h"
#include "model/model.h"

// The centre other than `weak` most similar to it (ties -> lower position); -1 when none.
static int32_t most_similar(const struct kv_list *l, struct ems_list *s, int32_t d, int32_t nc, int32_t weak,
                            float *r_best) {
    float *r = s->work, *tmp = s->work + s->cap;
    struct ems_probe probe;
    ems_probe_init(&probe, l, d, weak);
    ems_redundancy_all(l, s, d, &probe, nc, r, tmp);
    const int32_t best = ems_most_similar_pick(r, l->pos, nc, weak);
    if (best >= 0) *r_best = r[best];
    return best;
}

pykv_status ems_decode_list(const struct policy_event *ev, const struct ems_opts *o, int32_t B, int32_t g,
                            struct ems_list *s, int roll) {
    struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const int32_t d = ev->hp->head_dim;
    const int64_t cap = (int64_t)o->gamma * B;
    const int G = ev->hp->n_head / ev->hp->n_head_kv;
    double sum_glo, sum_loc;
    ems_step_scores(s, ev->attn_colsum + (size_t)g * G * ev->attn_colsum_stride, ev->attn_colsum_stride, G, roll,
                    &sum_glo, &sum_loc);
    if (B <= 0 || l->n <= B) return PYKV_OK;
    int64_t members = ems_member_count(l);
    pykv_status st = PYKV_OK;
    while (st == PYKV_OK && l->n > B) {
        const int32_t n = l->n, P = o->window < n ? o->window : n, nc = n - P;
        if (nc < 1) break;
        const float a = ems_alignment(sum_loc, sum_glo);
        const int32_t weak = ems_weakest_centre(s, l->pos, nc, a);
        int32_t best = -1;
        float r_best = 0.0f;
        if (o->tau < 1.0 && members <= cap && nc > 1) best = most_similar(l, s, d, nc, weak, &r_best);
        if (best >= 0 && (double)r_best >= o->tau) {   // the sums and the member count stay
            st = ems_merge_into(ev->cache, l, s, d, best, &weak, 1);
        } else {
            sum_glo -= s->glo[weak];
            sum_loc -= s->lp[weak] + s->lc[weak];
            members -= ems_members(l, weak);
        }
        if (st == PYKV_OK) {
            ems_list_drop(s, weak, P);
            st = kv_list_drop(ev->cache, l, weak, P);
        }
    }
    return st;
}
