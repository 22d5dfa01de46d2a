// take-score.h - TAKE's probe machinery (docs/policies.md#take): the EMA of the probe queries
// across prefill chunks in pre-RoPE space, and the probe's attention scores over a layer's
// lists.
//
// Choices:
//  * [ours] the EMA runs on pre-RoPE queries: each chunk's probe rows are
//    un-rotated with their own positions, mixed Qa = alpha*Qa_prev + (1-alpha)*Q_now, and
//    the result is rotated to the current probe positions before scoring. Rows are aligned
//    at the end: when the row count changes (a short last chunk, an explicit probe longer
//    or shorter than the last chunk's tail) row r of the new set pairs with row
//    r + (rows_prev - rows) of the old one; rows without a partner start from Q_now.
//  * Scoring: row r of the probe sits at position pos0 + r and attends (fp32 softmax,
//    scale 1/sqrt(d)) over the first n_cols entries of its KV head's list, causal by
//    position (entries with pos > pos0 + r are masked; this matters only in the last chunk,
//    whose probe is the prompt's real tail). The softmax runs over those columns only, so
//    appended probe keys are excluded from the normaliser, as in the paper's eq. 9.
//  * Score = mean over the probe rows, then the mean over the query heads of the KV head
//    (GQA mean, [ours]), then avg pooling along the list (PyTorch
//    semantics: zeros outside, still counted). avg pooling and the GQA mean are linear, so
//    this order equals pool-then-reduce up to float rounding.
//  * Each query head is one task of the thread pool writing only its own row, so the
//    result does not depend on the number of threads.
#pragma once
#include <stdint.h>
#include "kv/policy.h"

// Rotate `rows` rows of (n_head, head_dim) queries, row r at position pos0 + r, by
// sign * position (sign -1 undoes RoPE, +1 applies it); only the first n_rot dims turn.
void take_rotate(float *q, int32_t rows, int32_t n_head, int32_t head_dim, int32_t n_rot, int32_t pos0,
                 int sign, const float *inv_freq);
// The RoPE table take_rotate turns a row at position pos with (n_rot floats, rope_angles's
// layout): the GPU path's tables for the same rotations.
void take_rope_angles(float *cs, int32_t n_rot, int32_t pos, int sign, const float *inv_freq);

// EMA state of one layer: `rows` pre-RoPE probe rows (rows * n_head * head_dim floats), in
// host memory, or for a layer on the GPU in device memory (d_q[d_cur]; the other buffer takes
// the next state).
struct take_ema {
    float  *q;
    int32_t rows;
    int32_t cap_rows;
    float  *d_q[2];
    int32_t d_cur, d_cap_rows;
};
void take_ema_free(struct take_ema *e);

// Mix the post-RoPE probe rows `now` (rows at positions pos0..) into e and write the
// mixed rows, rotated to those positions, to out (rows * n_head * head_dim floats).
pykv_status take_ema_update(struct take_ema *e, const float *now, int32_t rows, int32_t pos0, double alpha,
                            const struct policy_event *ev, float *out);

// How each probe row's attention counts in the mean over the rows.
enum take_row_weight {
    TAKE_ROWS_EQUAL = 0,     // every row alike (TAKE)
    TAKE_ROWS_BY_SEEN = 1,   // each row times the number of columns it sees: a row that spreads its
                             // attention over more entries counts as much as a shorter one (FINCH)
};

// The same for a layer on the GPU (ev->q_device set; take-score-gpu.c), all of it there: the
// chunk's last `rows` query rows mixed into e's device state, the mixed rows rotated into
// d_out (device, rows * n_head * head_dim floats).
pykv_status take_ema_update_device(struct take_ema *e, int32_t rows, int32_t pos0, double alpha,
                                   const struct policy_event *ev, float *d_out);

// Scores of one layer: for KV head g, n_cols[g] values at scores + offset[g] (offset is
// the running sum of n_cols). qa: (rows, n_head, head_dim) post-RoPE probe at pos0..., in
// host memory, or in device memory when qa_on_device (a layer on the GPU).
pykv_status take_layer_scores(const struct policy_event *ev, const float *qa, int qa_on_device, int32_t rows,
                              int32_t pos0, const int32_t *n_cols, const int64_t *offset, int32_t kernel,
                              enum take_row_weight weight, float *scores);

// The probe's causal limits on a layer's lists, as the window kernel takes them
// (cuda_window_args.vis): vis[r * n_head_kv + g] = how many of the first n_cols[g] entries of
// list g probe row r, at position pos0 + r, sees (those at positions up to its own).
void take_probe_visible(const struct policy_event *ev, int32_t rows, int32_t pos0, const int32_t *n_cols,
                        int32_t *vis);

// A layer on the GPU (ev->q_device set; take-score-gpu.c): take_layer_scores' scores computed
// there.
pykv_status take_layer_scores_device(const struct policy_event *ev, const float *qa, int qa_on_device, int32_t rows,
                                     int32_t pos0, const int32_t *n_cols, int32_t kernel,
                                     enum take_row_weight weight, float *scores);
