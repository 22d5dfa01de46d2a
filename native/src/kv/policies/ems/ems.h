// ems.h - shared state and helpers of the EMS policy (docs/policies.md#ems), split by concern:
//   ems.c         vtable, options, per-list score bookkeeping, the after_layer schedule
//   ems-score.c   the local score s_Loc of a prefill call (last L_win queries, members expanded)
//   ems-merge.c   redundancy R(i, c) and the weighted merge of entries into a centre
//   ems-prefill.c end of prefill: global-local score, centre / TBM / evict partition, merges
//   ems-decode.c  every decode step: window -> centre, weakest centre merged or evicted
//   ems-step.c    the decode step's scans of a list (scores and sums, weakest centre, most similar)
//   ems-gpu-prefill.c  end of prefill on lists in GPU memory
//   ems-gpu.c     the decode step of lists in GPU memory, every list's done together
// Every choice is documented in ems.c's header comment.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "kv/policy.h"

// Per-(layer, KV head) scores, one slot per list entry, compacted alongside the list.
struct ems_list {
    int32_t n, cap;
    float  *glo;    // s_Glo: accumulated attention of every query (GQA mean), member mass for merged entries
    float  *lp;     // s_Loc_past (after a prefill: its s_Loc)
    float  *lc;     // s_Loc_cur: this decode block's attention
    float  *wsum;   // merged entries: sum of the members' merge weights (unused for single tokens)
    float  *kmag;   // merged entries: |sum_i w_i k̂_i| / wsum (so sum_i w_i k̂_i = wsum * kmag * k̂_e)
    float  *inv;    // 1 / (|key| |value|) as stored (0 if either is zero); -1 = not computed yet
    float  *work;   // (2 * cap) a decode step's redundancies; not per entry, never moved
};

struct ems_opts {
    int32_t window;   // L_win
    int32_t kernel;   // mean-pool kernel over the candidates (odd)
    double  tau;      // merge threshold on R; 1 = evict only
    int32_t gamma;    // merge magnification: (gamma-1)*B TBM tokens, members capped at gamma*B
};

pykv_status ems_list_track(struct ems_list *s, int32_t n);
void        ems_list_compact(struct ems_list *s, const int32_t *keep, int32_t n_keep);
void        ems_list_drop(struct ems_list *s, int32_t j, int32_t tail);   // as kv_list_drop moves the entries
void        ems_list_free(struct ems_list *s);

// s_Loc of every entry of every list of ev->layer over the last `rows` queries of the chunk
// (sum over rows, GQA mean; merged entries get their members' total mass): out[g] has l->n
// floats for KV head g. Deterministic for any thread count.
pykv_status ems_local_scores(const struct policy_event *ev, int32_t rows, float **out);

// Entry i as float32 with its inverse norms, computed once for its redundancy to every centre.
struct ems_probe { float k[PYKV_MAX_HEAD_DIM], v[PYKV_MAX_HEAD_DIM]; float inv; };
void ems_probe_init(struct ems_probe *p, const struct kv_list *l, int32_t d, int32_t i);
// R(i, c) = cos(k_i, k_c) * cos(v_i, v_c) on the stored keys, for the probe's entry i; a pair
// with a negative key or value cosine gets -|product| (never similar).
float ems_redundancy(const struct kv_list *l, int32_t d, const struct ems_probe *p, int32_t c);
// The same R of the probe against each of entries [0, nc): r[c] (tmp: nc floats), with the
// entries' inverse norms cached in s (computed where still unknown).
void ems_redundancy_all(const struct kv_list *l, struct ems_list *s, int32_t d, const struct ems_probe *p,
                        int32_t nc, float *r, float *tmp);

// Merge entries src[0..n_src) of list l into entry c (in place: c's key becomes the unit
// direction, its value the weighted mean, its member norms the union). A single token's
// weight is its s_Loc = lp + lc (a prefill sets lp to its s_Loc and lc to 0 first). Updates
// s (glo, lp, lc, wsum, kmag of c). The caller drops the sources afterwards.
pykv_status ems_merge_into(struct kv_cache *cache, struct kv_list *l, struct ems_list *s, int32_t d, int32_t c,
                           const int32_t *src, int32_t n_src);
// The same merge reading the entries' rows through `rows` and leaving c's new key and value
// in k and v (d floats each) for the caller to store (a device list's rows are elsewhere).
struct ems_rows {
    const float *(*row)(const void *arg, int32_t e, int values, float *tmp);   // entry e's key or value as floats
    const void *arg;
};
pykv_status ems_merge_rows(struct kv_cache *cache, struct kv_list *l, struct ems_list *s, int32_t d, int32_t c,
                           const int32_t *src, int32_t n_src, const struct ems_rows *rows, float *k, float *v);

static inline int32_t ems_members(const struct kv_list *l, int32_t j) {
    return l->n_members ? l->n_members[j] : 1;
}
// The tokens the list's entries stand for (the member cap's count).
static inline int64_t ems_member_count(const struct kv_list *l) {
    int64_t members = l->n;
    if (l->n_members)
        for (int32_t j = 0; j < l->n; j++) members += l->n_members[j] - 1;
    return members;
}

// The mean alignment a = sum(s_Loc) / sum(s_Glo) over a list (1 when s_Glo sums to 0).
static inline float ems_alignment(double sum_loc, double sum_glo) {
    return sum_glo > 0.0 ? (float)(sum_loc / sum_glo) : 1.0f;
}

// The mean-aligned global-local score of entries [0, n_cand) of a list:
// gl[j] = max(a * glo[j], loc[j]), a = sum(loc over all n) / sum(glo over all n).
void ems_global_local(const float *glo, const float *loc, int32_t n, int32_t n_cand, float *gl);

// The GQA mean of G rows of attention sums (`stride` floats apart) at entries [j, j + m):
// a[i] = (row 0 + row 1 + ...) / G, summed in row order.
void ems_rows_mean(const float *rows, size_t stride, int G, int32_t j, int32_t m, float *a);
// A decode step's attention into a list's scores: s_Glo and s_Loc_cur += the GQA mean of the
// G rows of attention sums (`stride` floats apart); when `roll`, s_Loc_cur then replaces
// s_Loc_past and restarts at 0. Returns the sums over the list of s_Glo and of s_Loc =
// lp + lc (four double partial sums, entry j into partial j % 4), for the mean alignment.
void ems_step_scores(struct ems_list *s, const float *rows, size_t stride, int G, int roll, double *sum_glo,
                     double *sum_loc);
// The weakest of the nc centres (entries [0, nc)) by s_GL = max(a s_Glo, s_Loc); ties -> the
// lower position. Uses the list's scratch (s->work).
int32_t ems_weakest_centre(const struct ems_list *s, const int32_t *pos, int32_t nc, float a);
// The entry c != weak of [0, nc) with the largest r[c], ties -> the lower position; -1 when
// there is none.
int32_t ems_most_similar_pick(const float *r, const int32_t *pos, int32_t nc, int32_t weak);
// Tests: nonzero makes these take their scalar paths (the SIMD ones must give the same results).
void ems_step_force_scalar(int on);

pykv_status ems_prefill_list(const struct policy_event *ev, const struct ems_opts *o, int32_t B, int32_t g,
                             struct ems_list *s, const float *loc);
// The steps of ems_prefill_list, shared with the device lists' (ems-gpu-prefill.c):
// ems_partition sets s_Loc (lp = loc, lc = 0) and, for a list over B (order set; NULL
// otherwise), ranks the candidates: order[0 .. n_imp) the centres, ascending, then the n_tbm
// TBM entries in rank order, whose most similar centre (row) and R the caller fills into
// best and r (best -1: none). ems_prefill_merge assigns them in rank order (R >= tau, the
// member cap) and has m merge each centre's; ems_prefill_keep keeps the centres and the window.
struct ems_partition {
    int32_t  nc, n_imp, n_tbm;
    int32_t *order;
    int32_t *best;   // (n_tbm)
    float   *r;      // (n_tbm)
};
struct ems_merger {
    pykv_status (*merge)(void *arg, int32_t c, const int32_t *src, int32_t n_src);
    void *arg;
};
pykv_status ems_partition(const struct ems_opts *o, int32_t B, const struct kv_list *l, struct ems_list *s,
                          const float *loc, struct ems_partition *pt);
void        ems_partition_free(struct ems_partition *pt);
pykv_status ems_prefill_merge(struct kv_list *l, const struct ems_opts *o, int32_t B, const struct ems_partition *pt,
                              const struct ems_merger *m);
pykv_status ems_prefill_keep(struct kv_cache *cache, struct kv_list *l, struct ems_list *s,
                             const struct ems_partition *pt);
// The prefill end of every list of a layer in GPU memory (ems-gpu-prefill.c): the partitions
// on the host, every TBM entry's most similar centre in one launch, the merging lists' rows
// brought down and the merged rows sent up in batches, the lists compacted on the device.
// loc[g]: list g's s_Loc.
pykv_status ems_gpu_prefill_layer(const struct policy_event *ev, const struct ems_opts *o, int32_t B,
                                  struct ems_list *lists, float *const *loc);
// A decode step of list g (after it has attended): the step's attention into the scores
// (s_Loc_cur replaces s_Loc_past when `roll`), then, with a budget B > 0, the list back to B.
pykv_status ems_decode_list(const struct policy_event *ev, const struct ems_opts *o, int32_t B, int32_t g,
                            struct ems_list *s, int roll);

// The same on a device list (ems-gpu.c): the scores now, the list's step queued on *gp
// (created when needed) and done for every queued list by ems_gpu_after_step, which with
// `discard` (a hook of the step failed) forgets them instead.
struct ems_gpu;
pykv_status ems_gpu_decode_list(struct ems_gpu **gp, const struct policy_event *ev, int32_t B, int32_t g,
                                struct ems_list *s, int roll);
pykv_status ems_gpu_after_step(struct ems_gpu *e, struct kv_cache *c, const struct ems_opts *o, int32_t B,
                               int discard);
void        ems_gpu_free(struct ems_gpu *e);

// The GQA mean of the step's attention on entries [j0, j0 + m) of list g: a[i] for entry j0 + i.
void ems_attention_mean(const struct policy_event *ev, int32_t g, int32_t j0, int32_t m, float *a);
