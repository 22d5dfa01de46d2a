// ops.c - norm, RoPE, SwiGLU and the threaded matrix multiply (softmax: softmax.c).
#include "ops.h"
#include "gemm.h"
#include "quant.h"
#include "quant-q8.h"
#include "types.h"

#include <math.h>
#include <string.h>

void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0.0;   // double: the sum of squares of a few thousand values, once per row
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

void rope_inv_freq(float *inv_freq, int n_rot, float base, const float *freq_factors) {
    for (int i = 0; i < n_rot / 2; i++) {
        double f = pow((double)base, -2.0 * i / n_rot);
        if (freq_factors) f /= freq_factors[i];
        inv_freq[i] = (float)f;
    }
}

void rope(float *x, int n_heads, int head_dim, int n_rot, int32_t pos, const float *inv_freq) {
    for (int i = 0; i < n_rot / 2; i++) {
        float theta = (float)pos * inv_freq[i];
        float c = cosf(theta), s = sinf(theta);
        for (int h = 0; h < n_heads; h++) {
            float *p = x + (size_t)h * head_dim + 2 * i;
            float a = p[0], b = p[1];
            p[0] = a * c - b * s;
            p[1] = a * s + b * c;
        }
    }
}

void swiglu(float *out, const float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

pykv_status tensor_get_row(const struct tensor *t, int64_t row, float *out) {
    int64_t row_bytes = type_row_bytes(t->type, t->ne[0]);
    return dequant_row(t->type, (const uint8_t *)t->data + row * row_bytes, out, t->ne[0]);
}

struct matmul_job {
    float               *out;
    const struct tensor *w;
    const float         *x;
    const block_q8_act  *xq;   // x quantised, for the integer path
    vec_dot_q8_fn        dot_q8;
    int                  T;
    float               *scratch;
};

// One token: a fused dequantize-and-dot per weight row.
static void matmul_vec_task(void *arg, int ith, int nth) {
    const struct matmul_job *job = arg;
    const struct tensor *w = job->w;
    int64_t cols = w->ne[0], row_bytes = type_row_bytes(w->type, cols);
    vec_dot_fn dot = vec_dot_for(w->type);
    long r0, r1;
    split_range(w->ne[1], ith, nth, &r0, &r1);
    const uint8_t *base = w->data;
    for (long r = r0; r < r1; r++) job->out[r] = dot(base + r * row_bytes, job->x, cols);
}

// One token, fast path: integer dot products with the quantised activations.
static void matmul_q8_task(void *arg, int ith, int nth) {
    const struct matmul_job *job = arg;
    const struct tensor *w = job->w;
    int64_t cols = w->ne[0], row_bytes = type_row_bytes(w->type, cols);
    long r0, r1;
    split_range(w->ne[1], ith, nth, &r0, &r1);
    const uint8_t *base = w->data;
    for (long r = r0; r < r1; r++) job->out[r] = job->dot_q8(base + r * row_bytes, job->xq, cols);
}

// Many tokens: dequantize a block of rows once, then take its dot products with every token,
// so the weights are read once per chunk rather than once per token.
static void matmul_batch_task(void *arg, int ith, int nth) {
    const struct matmul_job *job = arg;
    const struct tensor *w = job->w;
    int64_t cols = w->ne[0], rows = w->ne[1], row_bytes = type_row_bytes(w->type, cols);
    float *block = job->scratch + (size_t)ith * MATMUL_SCRATCH_FLOATS(cols);
    long n_blocks = (long)((rows + MATMUL_ROW_BLOCK - 1) / MATMUL_ROW_BLOCK);
    long b0, b1;
    split_range(n_blocks, ith, nth, &b0, &b1);
    const uint8_t *base = w->data;
    for (long b = b0; b < b1; b++) {
        long r0 = b * MATMUL_ROW_BLOCK;
        long nr = rows - r0 < MATMUL_ROW_BLOCK ? rows - r0 : MATMUL_ROW_BLOCK;
        for (long i = 0; i < nr; i++)
            dequant_row(w->type, base + (r0 + i) * row_bytes, block + i * cols, cols);
        gemm_rows_f32(block, (int)nr, job->x, job->T, (int)cols, job->out + r0, rows);
    }
}

void matmul(struct threadpool *pool, float *out, const struct tensor *w, const float *x, int T,
            const struct matmul_buf *buf) {
    struct matmul_job job = { out, w, x, NULL, NULL, T, buf->dequant };
    if (T == 1 && !buf->exact && w->ne[0] % QK8_ACT == 0 && (job.dot_q8 = vec_dot_q8_for(w->type))) {
        quantize_row_q8_act(x, buf->xq, w->ne[0]);
        job.xq = buf->xq;
        threadpool_run(pool, matmul_q8_task, &job);
        return;
    }
    threadpool_run(pool, T == 1 ? matmul_vec_task : matmul_batch_task, &job);
}
