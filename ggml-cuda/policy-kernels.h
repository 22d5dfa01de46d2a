// policy-kernels.h - device building blocks of the KV eviction policies, callable from C:
// gathering, moving and copying rows, the observation-window scores of the SnapKV family, the
// scores of single entries (Knorm, KeyDiff, LagKV), Expected Attention's scores, CriticalKV's
// value weights, KVzip's reconstruction pass, a decode step's attention probabilities, EMS's
// redundancy, TAKE's probe average, value norms and top-k selection.
// Each launcher enqueues its work on stream s and returns at once (launch errors surface at
// cuda_check or the next synchronising call). Pointers named d_* and every array argument not
// said to be host memory are device memory. Each kernel has a CPU twin (named below);
// tests/c/test_cuda_policy.c compares them, tests/c/test_cuda_policy_host.cu checks the
// per-element math on the host.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "device.h"
#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- row gather and moves (kv-gather.cu) ----
// Row j of dst = row keep[j] of src for j < n_keep, rows of row_bytes bytes (any size: keys
// and values in their stored format, 4-byte positions). Out of place: dst and src must not
// overlap; keep may hold any in-range indices in any order. Twin: kv_compact_rows applied to
// a copy of src (whose keep must be ascending).
void cuda_gather_rows(cuda_stream s, void *dst, const void *src, size_t row_bytes, const int32_t *d_keep,
                      int32_t n_keep);

// Moves of rows inside one buffer, done in order: move i copies len[i] rows from row src[i]
// to row dst[i], with dst[i] <= src[i] (rows only move towards the front, as compaction moves
// them; the ranges may overlap). A decode step's eviction from a list that keeps its room:
// a few runs, in place, with no index array to upload. Twin: kv_compact_rows and kv_drop_row,
// whose memmoves these are.
#define CUDA_MAX_ROW_MOVES 8
struct cuda_row_moves {
    int32_t n;   // moves, at most CUDA_MAX_ROW_MOVES
    int32_t dst[CUDA_MAX_ROW_MOVES], src[CUDA_MAX_ROW_MOVES], len[CUDA_MAX_ROW_MOVES];
};
void cuda_move_rows(cuda_stream s, void *d_base, size_t row_bytes, const struct cuda_row_moves *m);
// The moves of many buffers in one launch (a decode step's evictions over every list): job i
// moves rows of its own buffer as cuda_move_rows does; no two jobs may share a buffer.
struct cuda_list_moves {
    void                  *base;
    int64_t                row_bytes;
    struct cuda_row_moves  m;
};
void cuda_move_rows_many(cuda_stream s, const struct cuda_list_moves *d_jobs, int32_t n);

// Independent copies of bytes between device buffers, in any order (their destinations must
// not overlap each other or any source): a batch of scattered rows sent with one launch
// (kv/kv-device-batch.c). Twin: memcpy per job.
struct cuda_byte_copy {
    void       *dst;
    const void *src;
    int64_t     bytes;
};
void cuda_copy_bytes(cuda_stream s, const struct cuda_byte_copy *d_jobs, int32_t n);

// ---- observation-window scores (window-scores.cu) ----
// Twin: ws_stats_compute and ws_layer_scores (native/src/kv/policies/common/window-scores.c),
// docs/policies.md#the-observation-window. One layer: list g of `layer` (plain entries, no
// merged ones) holds n[g] entries, the last `protect` of them the window, the first
// n_cand[g] = max(n[g] - protect, 0) the candidates. Window row r (0 <= r < rows) is chunk
// token T - rows + r: query head h of it (q + ((T - rows + r) * n_head + h) * head_dim)
// attends with an fp32 softmax of q.k / sqrt(head_dim) over the first n[g] - (rows - 1 - r)
// entries of list g = h / (n_head / n_head_kv). Per query head and candidate: the mean of its
// probability over the rows (every row sees every candidate) and, if asked, the unbiased
// variance (0 when rows == 1); then per KV head the GQA reduce of the mean over its query
// heads (mean or max, head order) and 1-D pooling along the candidates (stride 1, padding
// kernel / 2; avg counts the padding as zeros, max ignores it).
struct cuda_window_args {
    int32_t n_head;    // query heads, a multiple of layer->n_head_kv
    int32_t T;         // tokens of the chunk (rows of q)
    int32_t rows;      // window queries, 1 <= rows <= min(T, protect)
    int32_t protect;   // window entries at the end of every list
    int32_t pool;      // enum ws_pool: 0 max, 1 avg
    int32_t kernel;    // odd pooling kernel, >= 1 (1: no pooling)
    int32_t gqa;       // enum ws_gqa: 0 mean, 1 max
    // NULL: the window's causal rule above. Else (device, rows * n_head_kv) row r of KV head g
    // sees its first vis[r * n_head_kv + g] entries (TAKE's probe, causal by position), every
    // entry is a candidate (protect must be 0), and a row adds 0 for an entry it does not see.
    const int32_t *vis;
    // NULL, or (device, total * G doubles, laid out as mean) per candidate and query head the
    // sum over the rows of p log(p + 1e-10): CAKE's attention entropy, summed by the host.
    double        *ent;
    // With vis: nonzero weighs row r's probabilities by vis[r], the mean being their weighted
    // sum over rows (FINCH's normalisation; the variance stays unweighted).
    int32_t        weight_seen;
};

// Output layout (host memory in, host memory out): n_cand[g] and offset_kv[g] (either may be
// NULL) for each KV head g; returns total = the sum of n_cand. A per-KV-head array (scores)
// holds KV head g's n_cand[g] values at offset_kv[g] (the prefix sums of n_cand, head order);
// a per-query-head array (mean, var) holds KV head g's block of G = n_head / n_head_kv rows at
// offset_kv[g] * G, row i (query head g * G + i) at offset_kv[g] * G + i * n_cand[g]: the
// layouts of struct ws_stats (offset_kv, offset).
int64_t cuda_window_layout(const struct cuda_kv_layer *layer, int32_t protect, int32_t *n_cand, int64_t *offset_kv);

// Bytes of work for cuda_window_scores on these lists and arguments.
size_t cuda_window_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_window_args *a);

// scores: total floats (per KV head, ws_layer_scores); NULL skips the reduce and pooling.
// mean: NULL, or total * G floats (per query head, ws_stats.mean); NULL keeps it in work.
// var: NULL (not computed), or total * G floats (ws_stats.var). q: (T, n_head, head_dim).
// Does nothing for arguments out of range (rows < 1 or > T, > protect without vis, an even or < 1
// kernel, head_dim > 512 or not a multiple of 32 for q8_0 keys, n_head not a multiple of
// n_head_kv).
void cuda_window_scores(cuda_stream s, const struct cuda_kv_layer *layer, const float *q,
                        const struct cuda_window_args *a, float *scores, float *mean, float *var, void *work);

// ---- scores of single entries (entry-scores.cu) ----
// The question-agnostic scores of every entry of a layer's lists from its stored key and value
// alone, the CPU's bit for bit (LagKV's softmax aside, within an ulp of a double). Twins: the
// es_score_fn of knorm.c (-|k_j|), keydiff.c (-cos(k_j, the list's mean unit key)) and lagkv.c
// (partitions against the next: ranks or weights, sinks and the unscored tail 1).
#define CUDA_ENTRY_KNORM 1
#define CUDA_ENTRY_KEYDIFF 2
#define CUDA_ENTRY_LAGKV 3
#define CUDA_ENTRY_MAX_D 512
#define CUDA_LAGKV_MAX_LAG 1024
struct cuda_entry_args {
    int32_t rule;     // CUDA_ENTRY_*
    int32_t budget;   // lists of at most this many entries are not scored (their scores untouched)
    int32_t sink, lag, cross;   // LagKV's options
};
// Nonzero when the kernel takes these lists and arguments (head_dim <= CUDA_ENTRY_MAX_D; LagKV:
// 2 <= lag <= CUDA_LAGKV_MAX_LAG).
int    cuda_entry_supported(const struct cuda_kv_layer *layer, const struct cuda_entry_args *a);
size_t cuda_entry_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_entry_args *a);
// scores: one float per entry, list g's n[g] after those of the lists before it (the layout of
// cuda_window_layout with protect 0). Does nothing for arguments it does not take.
void   cuda_entry_scores(cuda_stream s, const struct cuda_kv_layer *layer, const struct cuda_entry_args *a,
                         float *scores, void *work);

// ---- Expected Attention's scores (expected-attention.cu) ----
// Twin: score_head and keep_list (native/src/kv/policies/expected-attention/). For query head
// h (list g = h / (n_head / n_head_kv)) and each entry j >= first[g] of its list: the logit
// m_h . k_j + k_j^T A_h k_j, softmax over those entries; then per entry of list g the mean of
// its query heads' probabilities (head order), times ||v_j||_2 with use_vnorm (after adding
// epsilon); entries before first[g] (the sinks) score +inf. Scores laid out as
// cuda_entry_scores' (list g's n[g] after the lists before it). Within rounding of the CPU's
// (the products A k are summed in another order).
#define CUDA_EA_MAX_D 256
struct cuda_ea_args {
    int32_t      n_head;
    const float *m;   // (n_head, d): the future query's mean, rotated, / sqrt(d)
    const float *A;   // (n_head, d, d): its covariance, rotated, / (2 d); NULL: no covariance term
    int32_t      first[CUDA_MAX_KV_HEADS];
    int32_t      use_vnorm;
    double       epsilon;
};
// Nonzero when the kernels take these lists and arguments (head_dim <= CUDA_EA_MAX_D).
int    cuda_ea_supported(const struct cuda_kv_layer *layer, const struct cuda_ea_args *a);
size_t cuda_ea_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_ea_args *a);
void   cuda_ea_scores(cuda_stream s, const struct cuda_kv_layer *layer, const struct cuda_ea_args *a, float *scores,
                      void *work);
// Its query statistics (twin: stats_head): one chunk's query rows t0 .. t0 + rows - 1 (q: (T,
// n_head, d), post-RoPE) with each row's rotation undone (cs: (rows, n_rot) cos, sin pairs),
// merged into a layer's running mean (n_head, d) and m2 (n_head, d, d) of `count` earlier
// queries, in double: the chunk's own mean and sum of outer products of its deviations (the
// products in float), then the pairwise update of Chan et al.
struct cuda_ea_chunk {
    int32_t      n_head, d, n_rot;
    int32_t      t0, rows;
    int64_t      count;
    const float *cs;
};
size_t cuda_ea_chunk_work_bytes(const struct cuda_ea_chunk *c);
void   cuda_ea_stats_chunk(cuda_stream s, const float *q, const struct cuda_ea_chunk *c, double *mean, double *m2,
                           void *work);

// ---- CriticalKV's value weights (value-weights.cu) ----
// Twin: critical_value_weights (native/src/kv/policies/criticalkv/critical.c). For each list g
// and candidate j < n_cand[g]: w[j at list g's offset] = the mean over g's query heads h of
// sum_r |wo[r, h * head_dim .. (h + 1) * head_dim) . v_j| (r < n_embd; wo: the layer's output
// projection as floats, (n_embd, n_head * head_dim), device memory); lists laid out one after
// another (the candidates of list g after those of the lists before it). Sums in float, in
// another order than the CPU's.
#define CUDA_VW_MAX_D 128
struct cuda_vw_args {
    int32_t      n_head, n_embd;
    const float *wo;
    int32_t      n_cand[CUDA_MAX_KV_HEADS];
};
int    cuda_value_weights_supported(const struct cuda_kv_layer *layer, const struct cuda_vw_args *a);
size_t cuda_value_weights_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_vw_args *a);
void   cuda_value_weights(cuda_stream s, const struct cuda_kv_layer *layer, const struct cuda_vw_args *a, float *w,
                          void *work);

// ---- KVzip's reconstruction pass (kvzip-pass.cu) ----
// Twin: pass_row (native/src/kv/policies/kvzip.c). Row t < T of the pass's queries (q: (T,
// n_head, head_dim), device), query head h, list g = h / (n_head / n_head_kv): one softmax of
// q . k / sqrt(head_dim) over the list's entries [0, sink[g]), [c0[g], c0[g] + width) and
// [self0[g], self0[g] + t]; best[h * width + j] = the largest weight chunk entry c0[g] + j
// gets from any row (0 for none). Float arithmetic in another order than the CPU's.
struct cuda_kvzip_args {
    int32_t n_head, T, width;
    int32_t sink[CUDA_MAX_KV_HEADS], c0[CUDA_MAX_KV_HEADS], self0[CUDA_MAX_KV_HEADS];
};
// Nonzero when the kernel takes these arguments (a row's logits fit in 48 KiB of shared memory).
int    cuda_kvzip_pass_supported(const struct cuda_kv_layer *layer, const struct cuda_kvzip_args *a);
size_t cuda_kvzip_pass_smem(const struct cuda_kv_layer *layer, const struct cuda_kvzip_args *a);
void   cuda_kvzip_pass(cuda_stream s, const struct cuda_kv_layer *layer, const float *q, const struct cuda_kvzip_args *a,
                       float *best);

// ---- a decode step's attention probabilities (attention-probs.cu) ----
// For each of the n_head query heads h (q + h * head_dim; list g = h / (n_head / n_head_kv)):
// out[h * stride + j] = softmax_j(q_h . key_j / sqrt(head_dim)) in fp32 over the list's n[g]
// entries, or n_dev[g] read when the kernel runs (a recorded decode step computes them at
// every step); a merged entry (layer->members) gets its members' total probability, each
// member's logit norm * q . key_j / sqrt(head_dim). Rows of at most stride entries. Twin:
// attention_weights (cpu/attention.c), the CPU decode step's attention sums. Does nothing for n_head not a
// multiple of n_head_kv or head_dim > 512.
void cuda_decode_probs(cuda_stream s, const struct cuda_kv_layer *layer, const float *q, int32_t n_head, float *out,
                       int64_t stride);

// ---- EMS's redundancy (ems-redundancy.cu) ----
// Job i: a list's stored keys k and values v (fmt_k, fmt_v, head_dim d <= 512), a probe entry
// `weak` and nc centres: rows centre[0 .. nc) (device memory), or rows 0 .. nc - 1 when centre
// is NULL. R(weak, c) = cos(k_weak, k_c) * cos(v_weak, v_c), formed as the CPU forms it: dots
// in fp32, inverse norms 1 / sqrt(|k|^2 |v|^2) with the product in double (0 when it is 0),
// and -|R| when either cosine is negative. Twins: ems_redundancy_all and ems_redundancy
// (native/src/kv/policies/ems/ems-merge.c).
struct cuda_ems_probe {
    const void    *k, *v;
    const int32_t *centre;
    int32_t        weak, nc;
    int64_t        out;
};
// r[out + c] = R(weak, centre c) for every c < nc. max_nc: the largest nc; at most 65535 jobs.
void cuda_ems_redundancy(cuda_stream s, const struct cuda_ems_probe *d_jobs, int32_t n_jobs, int32_t max_nc,
                         int fmt_k, int fmt_v, int d, float *r);
// best[out] = the row of the centre with the largest R (the first in centre order on a tie;
// -1 when nc is 0) and r_best[out] that R: ems_prefill_list's most similar centre of a
// to-be-merged entry.
void cuda_ems_most_similar(cuda_stream s, const struct cuda_ems_probe *d_jobs, int32_t n_jobs, int fmt_k, int fmt_v,
                           int d, int32_t *best, float *r_best);

// ---- TAKE's probe average (take-ema.cu) ----
// rows rows of width values in x (pre-RoPE probe queries): row r becomes a * old[r + shift]
// + b * x[r] where r + shift >= 0 (old: the kept rows), else stays; the results go to x and to
// state (which must not overlap old). Twin: the mixing loop of take_ema_update.
void cuda_take_ema(cuda_stream s, float *x, float *state, const float *old, int32_t rows, int32_t shift,
                   int64_t width, float a, float b);

// ---- value norms (value-norms.cu) ----
// out[g] = the largest L1 norm (sum of |v_i| in index order) among values 0 .. rows[g] - 1
// of list g of the layer, 0 when there are none; NaN norms are passed over. rows: host
// memory, one per KV head; out: n_head_kv floats. Twin: ws_value_l1_max (window-scores.c),
// equal bit for bit.
void cuda_value_l1_max(cuda_stream s, const struct cuda_kv_layer *layer, const int32_t *rows, float *out);

// ---- top-k selection (topk.cu) ----
// For each of m lists: list i is scores[off[i] .. off[i] + n[i]); its k = clamp(k[i], 0, n[i])
// largest, ties to the lower index, NaN ranking as -inf (and equal to it) and -0 equal to +0,
// go to idx[off[i] ..] as ascending indices into the list (count[i] = k when count is not
// NULL). Exactly the set of ws_select_top (window-select.c). off, n, k, idx, count: device
// arrays; idx needs room for k at each off[i] (sizing idx like scores suffices). One thread
// block per list: a radix select over 64-bit keys that are unique per list, then an
// order-keeping compaction.
void cuda_select_top(cuda_stream s, const float *scores, const int64_t *off, const int32_t *n, const int32_t *k,
                     int32_t m, int32_t *idx, int32_t *count);

#ifdef __cplusplus
}
#endif
