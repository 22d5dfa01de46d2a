// attention.c - softmax attention over a ragged list, plain or with merged entries.
#include "attention.h"
#include "ops.h"
#include "quant.h"

#include <math.h>
#include <string.h>

// Merged entries: member m of entry j has logit norm_m * s_j, all members share v_j, so
// entry j's weight is sum_m exp(norm_m * s_j - max) / Z (the EMS expansion).
static void merged_weights(const struct kv_list *l, int n, float *w) {
    float max = -INFINITY;
    for (int j = 0; j < n; j++) {
        const float *norm = l->member_norm[j];
        if (!norm) { if (w[j] > max) max = w[j]; continue; }
        for (int m = 0; m < l->n_members[j]; m++)
            if (norm[m] * w[j] > max) max = norm[m] * w[j];
    }
    double sum = 0.0;
    for (int j = 0; j < n; j++) {
        const float *norm = l->member_norm[j];
        float e = 0.0f;
        if (!norm) e = expf(w[j] - max);
        else for (int m = 0; m < l->n_members[j]; m++) e += expf(norm[m] * w[j] - max);
        w[j] = e;
        sum += e;
    }
    float inv = (float)(1.0 / sum);
    for (int j = 0; j < n; j++) w[j] *= inv;
}

void attention_head(const float *q, const struct kv_list *l, int n, int d, float *weights, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
    for (int j = 0; j < n; j++) weights[j] = dot_f32(q, l->k + (size_t)j * d, d) * scale;
    if (l->n_members) merged_weights(l, n, weights);
    else softmax(weights, n);
    memset(out, 0, (size_t)d * sizeof(float));
    for (int j = 0; j < n; j++) axpy_f32(out, weights[j], l->v + (size_t)j * d, d);
}
