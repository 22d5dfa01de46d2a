// ops.c - RoPE and the threaded matrix multiply (softmax: softmax.c; RMSNorm, SwiGLU: elementwise.c).
#include "cpu/ops.h"
#include "cpu/gemm.h"
#include "cpu/gemm-q8.h"
#include "cpu/quant.h"
#include "cpu/quant-q8.h"
#include "model/types.h"

#include <math.h>
#include <string.h>

void rope_inv_freq(float *inv_freq, int n_rot, float base, const float *freq_factors) {
    for (int i = 0; i < n_rot / 2; i++) {
        double f = pow((double)base, -2.0 * i / n_rot);
        if (freq_factors) f /= freq_factors[i];
        inv_freq[i] = (float)f;
    }
}

void rope_angles(float *cs, int n_rot, int32_t pos, const float *inv_freq) {
    for (int i = 0; i < n_rot / 2; i++) {
        const float theta = (float)pos * inv_freq[i];
        cs[2 * i] = cosf(theta);
        cs[2 * i + 1] = sinf(theta);
    }
}

void rope_rotate(float *x, int n_heads, int head_dim, int n_rot, const float *cs) {
    for (int h = 0; h < n_heads; h++) {
        float *p = x + (size_t)h * head_dim;
        for (int i = 0; i < n_rot / 2; i++) {
            const float c = cs[2 * i], s = cs[2 * i + 1], a = p[2 * i], b = p[2 * i + 1];
            p[2 * i] = a * c - b * s;
            p[2 * i + 1] = a * s + b * c;
        }
    }
}

pykv_status tensor_get_row(const struct tensor *t, int64_t row, float *out) {
    int64_t row_bytes = type_row_bytes(t->type, t->ne[0]);
    return dequant_row(t->type, (const uint8_t *)t->data + row * row_bytes, out, t->ne[0]);
}

// One token through up to MATMUL_MANY matrices that share the input x: their rows, taken
// end to end, are split evenly across the pool, so q/k/v (or gate/up) cost one dispatch.
// Each row is a fused dequantize-and-dot with x, or an integer dot with x quantised (xq).
struct matvec_job {
    int                  n;
    float               *out[MATMUL_MANY];
    const struct tensor *w[MATMUL_MANY];
    vec_dot_fn           dot[MATMUL_MANY];
    vec_dot_q8_fn        dot_q8[MATMUL_MANY];   // NULL: the float dot
    vec_dot4_q8_fn       dot4_q8[MATMUL_MANY];  // four rows at once; NULL: dot_q8 row by row
    const float         *x;
    const block_q8_act  *xq;
    long                 total_rows;
};

// Rows [r0, r1) of the concatenated matrices.
static void matvec_rows(const struct matvec_job *job, long r0, long r1) {
    long first = 0;
    for (int m = 0; m < job->n && first < r1; first += job->w[m]->ne[1], m++) {
        const struct tensor *w = job->w[m];
        const long a = (r0 > first ? r0 : first) - first, b = (r1 < first + w->ne[1] ? r1 : first + w->ne[1]) - first;
        const int64_t cols = w->ne[0], row_bytes = type_row_bytes(w->type, cols);
        const uint8_t *base = w->data;
        float *out = job->out[m];
        long r = a;
        if (job->dot4_q8[m]) {   // groups of four rows, counted from the matrix's first row
            for (; r < b && r % 4; r++) out[r] = job->dot_q8[m](base + r * row_bytes, job->xq, cols);
            for (; r + 4 <= b; r += 4) job->dot4_q8[m](base + r * row_bytes, row_bytes, job->xq, cols, out + r);
        }
        if (job->dot_q8[m]) for (; r < b; r++) out[r] = job->dot_q8[m](base + r * row_bytes, job->xq, cols);
        else                for (; r < b; r++) out[r] = job->dot[m](base + r * row_bytes, job->x, cols);
    }
}

// Each thread takes one contiguous share of the rows: a long sequential stream is what the
// hardware prefetcher follows best (interleaved chunks of rows break the stream up). The
// shares are whole groups of four rows, so that which rows take the four-row kernel (and
// so the rounding of each output) does not depend on the number of threads.
static void matvec_task(void *arg, int ith, int nth) {
    const struct matvec_job *job = arg;
    long g0, g1;
    split_range((job->total_rows + 3) / 4, ith, nth, &g0, &g1);
    const long r0 = 4 * g0, r1 = 4 * g1 < job->total_rows ? 4 * g1 : job->total_rows;
    if (r0 < r1) matvec_rows(job, r0, r1);
}

struct matmul_job {
    float               *out;
    const struct tensor *w;
    const float         *x;
    const pk_act        *xpk;   // x packed for the integer path; NULL: the float path
    int                  T;
    float               *scratch;
};

// Many tokens: unpack a block of rows once, then take its dot products with every token, so
// the weights are read once per chunk rather than once per token. The block is either
// dequantized to floats or, on the integer path, repacked (gemm-q8.h).
static void matmul_batch_task(void *arg, int ith, int nth) {
    const struct matmul_job *job = arg;
    const struct tensor *w = job->w;
    int64_t cols = w->ne[0], rows = w->ne[1], row_bytes = type_row_bytes(w->type, cols);
    float *block = job->scratch + (size_t)ith * matmul_scratch_floats(cols);
    pk_weight *packed = (pk_weight *)block;   // matmul_scratch_floats has room for either
    long n_blocks = (long)((rows + MATMUL_ROW_BLOCK - 1) / MATMUL_ROW_BLOCK);
    long b0, b1;
    split_range(n_blocks, ith, nth, &b0, &b1);
    const uint8_t *base = w->data;
    for (long b = b0; b < b1; b++) {
        long r0 = b * MATMUL_ROW_BLOCK;
        long nr = rows - r0 < MATMUL_ROW_BLOCK ? rows - r0 : MATMUL_ROW_BLOCK;
        if (job->xpk) {
            for (long i = 0; i < nr; i++)
                pack_weight_row(w->type, base + (r0 + i) * row_bytes, packed + i * pk_blocks(cols), cols);
            gemm_q8_rows(packed, (int)nr, job->xpk, job->T, cols, w->type, job->out + r0, rows);
        } else {
            for (long i = 0; i < nr; i++)
                dequant_row(w->type, base + (r0 + i) * row_bytes, block + i * cols, cols);
            gemm_rows_f32(block, (int)nr, job->x, job->T, (int)cols, job->out + r0, rows);
        }
    }
}

struct pack_job {
    const float *x;
    pk_act      *out;
    int          T;
    int64_t      cols;
};

static void pack_act_task(void *arg, int ith, int nth) {
    const struct pack_job *job = arg;
    long t0, t1;
    split_range(job->T, ith, nth, &t0, &t1);
    if (t1 > t0) pack_act_rows(job->x + t0 * job->cols, (int)(t1 - t0), job->cols, job->out + t0 * pk_blocks(job->cols));
}

// Prefill: each matrix in turn over all T tokens; x is packed once for those on the integer path.
static void matmul_batch(struct threadpool *pool, int n, float *const *outs, const struct tensor *const *ws,
                         const float *x, int T, const struct matmul_buf *buf, enum matmul_short_rows short_rows) {
    const pk_act *xpk = NULL;
    for (int m = 0; m < n; m++) {
        const int64_t cols = ws[m]->ne[0];
        const int packed = !buf->exact && gemm_q8_supports(ws[m]->type, cols) &&
                           (cols % PK_ELEMS == 0 || short_rows == MATMUL_SHORT_INT8);
        if (packed && !xpk) {
            struct pack_job pj = { x, buf->xpk, T, cols };
            threadpool_run(pool, pack_act_task, &pj);
            xpk = buf->xpk;
        }
        struct matmul_job job = { outs[m], ws[m], x, packed ? xpk : NULL, T, buf->dequant };
        threadpool_run(pool, matmul_batch_task, &job);
    }
}

void matmul_many(struct threadpool *pool, int n, float *const *outs, const struct tensor *const *ws,
                 const float *x, int T, const struct matmul_buf *buf, enum matmul_short_rows short_rows) {
    if (T > 1) {
        matmul_batch(pool, n, outs, ws, x, T, buf, short_rows);
        return;
    }
    struct matvec_job job = { .n = n, .x = x };
    int any_q8 = 0;
    for (int m = 0; m < n; m++) {
        job.out[m] = outs[m];
        job.w[m] = ws[m];
        job.dot[m] = vec_dot_for(ws[m]->type);
        if (!buf->exact && ws[m]->ne[0] % QK8_ACT == 0) job.dot_q8[m] = vec_dot_q8_for(ws[m]->type);
        if (job.dot_q8[m]) job.dot4_q8[m] = vec_dot4_q8_for(ws[m]->type);
        any_q8 |= job.dot_q8[m] != NULL;
        job.total_rows += ws[m]->ne[1];
    }
    if (any_q8) {   // the matrices share x, so it is quantised once
        quantize_row_q8_act(x, buf->xq, ws[0]->ne[0]);
        job.xq = buf->xq;
    }
    threadpool_run(pool, matvec_task, &job);
}

void matmul(struct threadpool *pool, float *out, const struct tensor *w, const float *x, int T,
            const struct matmul_buf *buf) {
    matmul_many(pool, 1, &out, &w, x, T, buf, MATMUL_SHORT_INT8);
}
