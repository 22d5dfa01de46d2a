// expected-attention.h - the Expected Attention policy's state and the steps its CPU and GPU
// paths share (docs/policies.md#expected_attention):
//   expected-attention.c      vtable, options, the query statistics, the scores on the CPU
//   expected-attention-gpu.c  the statistics, scores and selection of a layer on the GPU
#pragma once
#include <stdint.h>
#include "kv/policy.h"

struct kv_list;

// The query statistics of one layer in the current prefill call: its query heads' means
// (n_head, d) and sums of outer products of deviations from the mean (n_head, d, d), over
// `count` queries; allocated at the call's first chunk, freed at its last.
// A layer on the GPU keeps them in device memory while the call runs (d_stats: mean, then m2),
// brought into mean and m2 at its end.
struct ea_stats {
    int64_t count;
    double *mean;
    double *m2;
    void   *d_stats;
};

struct expected_attention {
    struct kv_policy base;
    int32_t          sink;
    int32_t          n_future;
    int32_t          use_cov;
    int32_t          use_vnorm;
    double           epsilon;
    int32_t          n_layer, n_head, d;
    struct ea_stats *stats;   // (n_layer), made at the first prefill
};

// The mean over positions [first, first + n) of cos and sin of each rotated pair's angle.
void    ea_average_rotation(const float *inv_freq, int n_rot, int32_t first, int32_t n, double *c, double *s);
// Query head hq's future query from the layer's statistics st: its rotated mean scaled by
// 1/sqrt(d) into m (d floats) and, with use_covariance, its rotated covariance scaled by
// 1/(2d) into A (d * d floats); dm (d) and dC (d * d) are double scratch.
void    ea_future_query(const struct expected_attention *p, const struct ea_stats *st, int n_rot, const double *cos_avg,
                        const double *sin_avg, int hq, float *m, float *A, double *dm, double *dC);
// The rows of the chunk the statistics take, t0 .. t0 + rows - 1 (positions >= sink), and, when
// there are some, *cs: each one's RoPE cos and sin (rows * n_rot floats; the caller frees it).
pykv_status ea_chunk_rows(const struct expected_attention *p, const struct policy_event *ev, int32_t *t0,
                          int32_t *rows, float **cs);
// The GPU's statistics (expected-attention-gpu.c): a chunk's queries (ev->q_device) merged
// into the layer's device statistics (made, or emptied at a call's first chunk, here);
// brought into the host's mean and m2; given back.
pykv_status ea_add_chunk_device(struct expected_attention *p, const struct policy_event *ev);
pykv_status ea_stats_download(struct expected_attention *p, const struct policy_event *ev);
void        ea_stats_device_free(struct ea_stats *st);
// The index of the first entry at a position >= sink (lists hold their entries in position
// order until a decode step's eviction, which this policy does not do).
int32_t ea_first_past_sinks(const struct kv_list *l, int32_t sink);
// A layer on the GPU at the end of a prefill call (expected-attention-gpu.c): the layer's
// statistics in p as the CPU has them; scores, selects and compacts there. *done is 0 when the
// device cannot (the caller then scores on the host).
pykv_status ea_compress_layer_device(struct expected_attention *p, const struct policy_event *ev, int32_t B, int *done);
