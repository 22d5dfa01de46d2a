// take-score.c - TAKE's probe EMA and probe-attention scores (see take-score.h).
#include "kv/policies/take/take-score.h"
#include "kv/policies/common/window-scores.h"
#include "cpu/attention.h"
#include "core/error.h"
#include "model/model.h"
#include "cpu/ops.h"
#include "cpu/quant.h"
#include "core/threadpool.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void take_rope_angles(float *cs, int32_t n_rot, int32_t pos, int sign, const float *inv_freq) {
    rope_angles(cs, n_rot, pos, inv_freq);   // the forward pass's angles
    if (sign < 0)
        for (int32_t i = 1; i < n_rot; i += 2) cs[i] = -cs[i];   // sin(-theta): the inverse rotation
}

void take_probe_visible(const struct policy_event *ev, int32_t rows, int32_t pos0, const int32_t *n_cols,
                        int32_t *vis) {
    const int32_t hkv = ev->hp->n_head_kv;
    for (int32_t g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        int32_t v = n_cols[g];
        for (int32_t r = rows - 1; r >= 0; r--) {   // causal by position, as score_head
            while (v > 0 && l->pos[v - 1] > pos0 + r) v--;
            vis[(size_t)r * hkv + g] = v;
        }
    }
}

void take_rotate(float *q, int32_t rows, int32_t n_head, int32_t head_dim, int32_t n_rot, int32_t pos0,
                 int sign, const float *inv_freq) {
    float cs[PYKV_MAX_HEAD_DIM];
    for (int32_t r = 0; r < rows; r++) {
        take_rope_angles(cs, n_rot, pos0 + r, sign, inv_freq);
        rope_rotate(q + (size_t)r * n_head * head_dim, n_head, head_dim, n_rot, cs);
    }
}

pykv_status take_ema_update(struct take_ema *e, const float *now, int32_t rows, int32_t pos0, double alpha,
                            const struct policy_event *ev, float *out) {
    const struct hparams *hp = ev->hp;
    const size_t width = (size_t)hp->n_head * hp->head_dim;
    if (rows > e->cap_rows) {
        float *q = malloc((size_t)rows * width * sizeof(float));
        if (!q) return pykv_error(PYKV_ERR_NOMEM, "out of memory for the TAKE probe state");
        if (e->rows > 0) memcpy(q, e->q, (size_t)e->rows * width * sizeof(float));
        free(e->q);
        e->q = q;
        e->cap_rows = rows;
    }
    memcpy(out, now, (size_t)rows * width * sizeof(float));
    take_rotate(out, rows, hp->n_head, hp->head_dim, hp->n_rot, pos0, -1, ev->probe.rope_inv_freq);   // pre-RoPE
    const int32_t shift = e->rows - rows;   // new row r pairs with old row r + shift
    const float a = (float)alpha, b = (float)(1.0 - alpha);
    if (shift >= 0) {   // ascending r reads old rows at or after the row it writes
        for (int32_t r = 0; r < rows; r++) {
            const float *old = e->q + (size_t)(r + shift) * width;
            float *x = out + (size_t)r * width, *dst = e->q + (size_t)r * width;
            for (size_t i = 0; i < width; i++) dst[i] = x[i] = a * old[i] + b * x[i];
        }
    } else {            // descending r: old row r + shift lies before the row written
        for (int32_t r = rows - 1; r >= 0; r--) {
            float *x = out + (size_t)r * width, *dst = e->q + (size_t)r * width;
            if (r + shift >= 0) {
                const float *old = e->q + (size_t)(r + shift) * width;
                for (size_t i = 0; i < width; i++) dst[i] = x[i] = a * old[i] + b * x[i];
            } else {
                memcpy(dst, x, width * sizeof(float));
            }
        }
    }
    e->rows = rows;
    take_rotate(out, rows, hp->n_head, hp->head_dim, hp->n_rot, pos0, +1, ev->probe.rope_inv_freq);
    return PYKV_OK;
}

struct score_job {
    const struct policy_event *ev;
    const float   *qa;
    int32_t        rows, pos0;
    const int32_t *n_cols;
    float         *mean;     // per query head h: n_cols[g] values at mean_off[h]
    const int64_t *mean_off;
    float         *scratch;  // per query head: max n_cols floats
    int32_t        max_cols;
    enum take_row_weight weight;
};

static void score_head(const struct score_job *j, int32_t h) {
    const struct hparams *hp = j->ev->hp;
    const int32_t hd = hp->head_dim, g = h / (hp->n_head / hp->n_head_kv), n = j->n_cols[g];
    const struct kv_list *l = kv_cache_list(j->ev->cache, j->ev->layer, g);
    float *mean = j->mean + j->mean_off[h], *z = j->scratch + (size_t)h * j->max_cols;
    memset(mean, 0, (size_t)n * sizeof(float));
    for (int32_t r = 0; r < j->rows; r++) {
        const float *q = j->qa + ((size_t)r * hp->n_head + h) * hd;
        int32_t vis = n;
        while (vis > 0 && l->pos[vis - 1] > j->pos0 + r) vis--;   // causal by position
        if (vis == 0) continue;
        attention_weights(q, 1, l, vis, hd, z);
        const float w = j->weight == TAKE_ROWS_BY_SEEN ? (float)vis : 1.0f;
        for (int32_t c = 0; c < vis; c++) mean[c] += w * z[c];
    }
    const float inv = 1.0f / (float)j->rows;
    for (int32_t c = 0; c < n; c++) mean[c] *= inv;
}

static void score_task(void *arg, int ith, int nth) {
    const struct score_job *j = arg;
    long h0, h1;
    split_range(j->ev->hp->n_head, ith, nth, &h0, &h1);
    for (long h = h0; h < h1; h++) score_head(j, (int32_t)h);
}

pykv_status take_layer_scores(const struct policy_event *ev, const float *qa, int qa_on_device, int32_t rows,
                              int32_t pos0, const int32_t *n_cols, const int64_t *offset, int32_t kernel,
                              enum take_row_weight weight, float *scores) {
    const struct hparams *hp = ev->hp;
    if (ev->q_device) return take_layer_scores_device(ev, qa, qa_on_device, rows, pos0, n_cols, kernel, weight, scores);
    if (qa_on_device) return pykv_error(PYKV_ERR_INTERNAL, "take: a probe in GPU memory for a layer on the CPU");
    const int32_t G = hp->n_head / hp->n_head_kv;
    int32_t max_cols = 1;
    int64_t total = 0;
    for (int32_t g = 0; g < hp->n_head_kv; g++) {
        if (n_cols[g] > max_cols) max_cols = n_cols[g];
        total += n_cols[g];
    }
    int64_t *mean_off = malloc((size_t)hp->n_head * sizeof(int64_t));
    float *mean = malloc((size_t)(total * G + 1) * sizeof(float));
    float *scratch = malloc((size_t)hp->n_head * max_cols * sizeof(float));
    float *red = malloc((size_t)max_cols * sizeof(float));
    if (!mean_off || !mean || !scratch || !red) {
        free(mean_off); free(mean); free(scratch); free(red);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring the TAKE probe (%lld entries)", (long long)total);
    }
    for (int32_t h = 0; h < hp->n_head; h++) mean_off[h] = offset[h / G] * G + (int64_t)(h % G) * n_cols[h / G];
    struct score_job job = { ev, qa, rows, pos0, n_cols, mean, mean_off, scratch, max_cols, weight };
    if (ev->pool) threadpool_run(ev->pool, score_task, &job);
    else score_task(&job, 0, 1);
    for (int32_t g = 0; g < hp->n_head_kv; g++) {
        if (n_cols[g] == 0) continue;
        ws_gqa_reduce(mean + mean_off[g * G], n_cols[g], G, n_cols[g], WS_GQA_MEAN, red);
        ws_pool1d(red, n_cols[g], kernel, WS_POOL_AVG, scores + offset[g]);
    }
    free(mean_off); free(mean); free(scratch); free(red);
    return PYKV_OK;
}
