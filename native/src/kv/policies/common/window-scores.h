// window-scores.h - shared machinery of the observation-window policies (SnapKV family).
//
// docs/policies.md#the-observation-window: the last W queries of a prefill call attend (fp32 softmax, causal
// inside the window) over every entry of their KV head's list; the per-query-head column
// mean (and optionally the unbiased variance) over those rows scores each candidate (the
// entries before the window). Then GQA reduce, pooling along the token axis, top-k
// selection (ties -> lower index) and the ascending keep list = chosen candidates + window.
#pragma once
#include <stdint.h>
#include "kv/policy.h"

enum ws_pool { WS_POOL_MAX = 0, WS_POOL_AVG = 1 };   // order of the "max|avg" choice
enum ws_gqa  { WS_GQA_MEAN = 0, WS_GQA_MAX = 1 };    // order of the "mean|max" choice

// Scoring options shared by the window policies (parsed from window/pool/kernel/gqa).
struct ws_opts {
    int32_t      window;   // W: protected tail of every list, and the scoring queries
    enum ws_pool pool;
    int32_t      kernel;   // odd pooling kernel size; 1 = no pooling
    enum ws_gqa  gqa;
};

// The window of one prefill call: `protect` entries at the end of every list are never
// evicted (min(W, n_prompt)); `rows` of them (min(protect, T), the last rows of ev->q)
// score the candidates. rows < protect only when n_ubatch < W.
struct ws_window {
    int32_t protect;
    int32_t rows;
};
struct ws_window ws_window_of(const struct policy_event *ev, int32_t W);

// The window attention of query head hq at chunk row t over the entries of its list that
// the query can see (causal, the first l->n - (T - 1 - t)): their probabilities in p, fp32,
// computed by attention_weights (the forward pass's kernels).
void ws_softmax_row(const struct policy_event *ev, const struct kv_list *l, int hq, int t, float *p);

// True in after_layer of the last chunk of a prefill call.
int ws_is_prefill_end(const struct policy_event *ev);

// Per-query-head column statistics of one layer. KV head g has n_cand[g] candidates; its
// block of G = n_head / n_head_kv rows (query heads g*G .. g*G+G-1) starts at offset[g]:
// row r of the block is mean + offset[g] + r * n_cand[g].
struct ws_stats {
    int32_t  n_head_kv, group;
    int32_t *n_cand;
    int64_t *offset;
    int64_t  total;      // sum of n_cand
    int64_t *offset_kv;  // start of KV head g in a per-KV-head array of `total` scores
    float   *mean;
    float   *var;      // NULL unless asked for (unbiased, 0 when rows == 1)
};
// A layer on the GPU (ev->q_device set) is scored there: ws_stats_device fills the means
// (and variances) of a laid-out st on the device (window-scores-gpu.c).
pykv_status ws_stats_compute(const struct policy_event *ev, struct ws_window w, int want_var, struct ws_stats *out);
void        ws_stats_free(struct ws_stats *s);
pykv_status ws_stats_device(const struct policy_event *ev, struct ws_window w, struct ws_stats *st);

// vbar[g] = the largest L1 norm among the values of candidates 0 .. n_cand[g] - 1 of list g
// of ev->layer (0 when none; NaN norms passed over): LAVa's value scale. On the GPU for a
// layer there (ws_value_l1_max_device, the same bits).
pykv_status ws_value_l1_max(const struct policy_event *ev, const int32_t *n_cand, float *vbar);
pykv_status ws_value_l1_max_device(const struct policy_event *ev, const int32_t *n_cand, float *vbar);

// Rows t0 .. t0 + rows - 1 of the chunk's queries ((rows, n_head, head_dim) floats) copied to
// out, from ev->q or, for a layer on the GPU, from ev->q_device.
pykv_status ws_query_rows(const struct policy_event *ev, int32_t t0, int32_t rows, float *out);
// The event as hooks on the CPU see it: *host = *ev, and for a layer on the GPU the chunk's
// queries (and probe rows) in host memory instead, brought down into *q_host, which the caller
// frees (NULL when nothing came down).
pykv_status ws_host_event(const struct policy_event *ev, struct policy_event *host, float **q_host);
pykv_status ws_query_rows_device(const struct policy_event *ev, int32_t t0, int32_t rows, float *out);

// A layer on the GPU (ev->q_device set; window-scores-gpu.c):
// row h of out (stride apart) = the attention query head h's list entries receive from the
// chunk's last `rows` queries, summed (causal: each sees the entries up to its own) - the
// forward pass's attention sums (policy_event.attn_colsum) and TOVA's last-query row;
pykv_status ws_attention_sums_device(const struct policy_event *ev, int32_t rows, float *out, size_t stride);
// CAKE's entropy of the window: -sum over query heads, window rows and the first n_cand[g]
// entries of each list of p log(p + 1e-10).
pykv_status ws_window_entropy_device(const struct policy_event *ev, struct ws_window w, const int32_t *n_cand,
                                     double *H);

#ifdef PYKV_CUDA
#include "ggml-cuda/policy-kernels.h"
// One run of the window kernel (ggml-cuda/window-scores.cu) on the lists kl of c's device,
// with its outputs brought to host memory. a.vis (rows * n_head_kv limits) is host memory and
// goes up for the run; the queries are d_q on the device, or q (a.rows rows) in host memory
// going up. scores (total floats), mean and var (total * G floats) and ent (total * G doubles)
// are filled when not NULL.
struct ws_device_run {
    const float *d_q;
    const float *q;
    float       *scores, *mean, *var;
    double      *ent;
};
pykv_status ws_window_run(const struct kv_cache *c, const struct cuda_kv_layer *kl, struct cuda_window_args a,
                          const struct ws_device_run *r);
#endif

// Reduce `group` rows of n values, row r at rows + r * stride, to one (mean or max); fixed
// order.
void ws_gqa_reduce(const float *rows, int64_t stride, int32_t group, int32_t n, enum ws_gqa mode, float *out);

// PyTorch-style 1-D pooling, stride 1, padding kernel/2 (kernel odd): avg counts the
// out-of-range zeros, max ignores them.
void ws_pool1d(const float *x, int32_t n, int32_t kernel, enum ws_pool type, float *out);

// The default SnapKV score of every KV head of the layer: mean -> GQA reduce -> pool,
// written to scores (st->total floats, KV head g at st->offset_kv[g]).
pykv_status ws_layer_scores(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                            struct ws_stats *st, float **scores);

// The k largest of s[0..n) (ties -> lower index), k clamped to [0, n), as ascending
// indices in idx (room for k). Returns the count.
pykv_status ws_select_top(const float *s, int64_t n, int64_t k, int64_t *idx, int64_t *n_out);
// order[0..n) = the indices of s[0..n) by rank, highest first (the same rank: ties -> lower
// index, NaN lowest); n at most INT32_MAX.
pykv_status ws_rank(const float *s, int64_t n, int32_t *order);

// Keep the chosen candidates (ascending indices < n_cand) and the window (entries from
// n_cand on) of list (ev->layer, g); frees the dropped entries.
pykv_status ws_keep(const struct policy_event *ev, int32_t g, const int64_t *chosen, int64_t n_chosen,
                    int32_t n_cand);

// Score the layer (ws_layer_scores) and keep the top b candidates of every KV head plus
// the window: SnapKV's step, with the budget per head given. A layer on the GPU scores and
// selects there (ws_layer_keep_top_device, the device radix select: the same sets), and only
// the chosen indices come back; *done is 0 when it left the step to the host path (a decode
// step's one-entry eviction, which kv_list_drop orders its own way).
pykv_status ws_layer_keep_top(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w, int64_t b);
pykv_status ws_layer_keep_top_device(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                                     int64_t b, int *done);

// A layer on the GPU: its window scores (ws_layer_scores' values, KV head g's n_cand[g] at
// offset_kv[g]) kept in device memory for the selections there, by the device radix select
// (the sets of ws_select_top), with only counts and chosen indices coming back. ws_device_scores_make
// scores the layer; free it with ws_device_scores_free (also after an error).
struct ws_device_scores {
    const struct policy_event *ev;
    int32_t  n_head_kv;
    int32_t *n_cand;      // (n_head_kv)
    int64_t *offset_kv;   // (n_head_kv)
    int64_t  total;       // sum of n_cand
    void    *d;           // the device block: the kernel's work, then the three below
    void    *d_scores, *d_idx, *d_lists;
};
pykv_status ws_device_scores_make(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                                  struct ws_device_scores *ds);
// The layout for lists with `protect` window entries and the device block, with `work` bytes
// of kernel work at ds->d, for scores that another kernel fills (ds->d_scores).
pykv_status ws_device_scores_alloc(const struct policy_event *ev, int32_t protect, size_t work,
                                   struct ws_device_scores *ds);
void        ws_device_scores_free(struct ws_device_scores *ds);
// The top k[i] of each of m lists of the scores (list i: d_scores off[i] .. off[i] + n[i]; host
// arrays, m <= n_head_kv, k[i] within [0, n[i]]) chosen by the device's radix select, queued:
// list i's ascending indices land at ds->d_idx + off[i] (device memory).
pykv_status ws_device_queue_select(const struct ws_device_scores *ds, int m, const int64_t *off, const int32_t *n,
                                   const int32_t *k);
// c[g] = how many of the layer's joint top K (all heads' scores ranked as one list, ties ->
// lower head, then lower position) belong to head g: Ada-KV's cross-head count.
pykv_status ws_device_joint_counts(const struct ws_device_scores *ds, int64_t K, int64_t *c);
// Every head g keeps its top b[g] candidates plus the window.
pykv_status ws_device_keep_top(const struct ws_device_scores *ds, const int64_t *b);

// A list's candidates as a cascade (CAKE, LAVa) re-selects them, in host memory: their scores
// and the list rows they live in. The list itself holds list_cand candidates (then its window).
struct ws_cascade_list {
    float   *s;          // (n_cand) scores
    int32_t *row;        // (n_cand) the list row of each, ascending
    int32_t  n_cand;     // candidates selected now
    int32_t  list_cand;  // candidates the list holds
};
// n_cand candidates at rows 0 .. n_cand - 1, their scores s left for the caller to fill.
// ws_cascade_free frees it (also after a failure).
pykv_status ws_cascade_init(struct ws_cascade_list *c, int32_t n_cand);
void        ws_cascade_free(struct ws_cascade_list *c);
// One re-selection of list g of ev->layer: its candidates narrow to the top b by s (s and row
// compacted in place). The list itself keeps exactly the rows left plus its window when
// `apply` is set or when it holds over 1.5x the rows left; row and list_cand then restart
// from them. Otherwise only the arrays change. A cascade applies at a layer's own step and at
// its last, so a list is compacted a few times (each one a third smaller) instead of once per
// later layer.
pykv_status ws_cascade_keep_top(const struct policy_event *ev, int32_t g, struct ws_cascade_list *c, int64_t b,
                                int apply);

// Keep the top b candidates of scores (n_cand of them) plus the window of list g.
pykv_status ws_keep_top(const struct policy_event *ev, int32_t g, const float *scores, int32_t n_cand, int64_t b);

// Option parsing: defaults (W=32, max, 7, mean) and the shared keys window, pool, kernel,
// gqa. ws_opts_arg returns 1 in *handled when the key was one of them.
void        ws_opts_default(struct ws_opts *o);
pykv_status ws_opts_arg(const char *policy, struct ws_opts *o, const char *key, const char *value, int *handled);
// Apply cfg->window (the window= constructor argument, -1 = default) and check the
// options; the budget check (B > W) happens with ws_check_budget once B is known.
pykv_status ws_opts_finish(const char *policy, struct ws_opts *o, const struct policy_config *cfg);
pykv_status ws_check_budget(const char *policy, int32_t B, int32_t W);
// The budget B for the current call (policy_budget): cfg->budget, or a share of the sequence
// as it stands at the end of the call.
int32_t     ws_budget(const struct policy_config *cfg, const struct policy_event *ev);
// The least budget of a window policy: its window (last_chunk_min) and one entry more.
int32_t     ws_min_budget(const struct kv_policy *p);
