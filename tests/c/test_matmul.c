// test_matmul.c - matmul() as the forward pass calls it, on a pool of threads: each path
// against a double-precision reference.
//   - exact mode (float activations): the plain dot of the dequantized rows, 1e-5 of the terms;
//   - one token (decode): the activations quantised per 32 (quantize_row_q8_act);
//   - several tokens (prefill) on the integer GEMM (the types it packs: rows of whole
//     256-element super-blocks, or for the 32-element types any multiple of 32, such as
//     SmolLM2's 576, with a short last super-block): the activations quantised per 32 as well;
//   - several tokens otherwise (F16, Q8_0 and IQ4 on a CPU without AVX-512 VNNI, and rows
//     that end short under MATMUL_SHORT_FLOAT): float.
// Shapes leave rows over from the 16-row blocks and tokens over from the kernels' tiles.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "cpu/gemm-q8.h"
#include "cpu/ops.h"
#include "cpu/quant-q8.h"
#include "random-rows.h"

enum { ROWS = 37 };

struct fixture {
    struct threadpool *pool;
    struct matmul_buf  buf;
};

static void fixture_init(struct fixture *f, int64_t max_cols, int max_T, int n_threads) {
    f->pool = threadpool_create(n_threads);
    f->buf.dequant = calloc((size_t)threadpool_size(f->pool) * matmul_scratch_floats(max_cols), sizeof(float));
    f->buf.xq = calloc(1, Q8_ACT_BYTES(max_cols));
    f->buf.xpk = calloc((size_t)(max_T * pk_blocks(max_cols) + 1), sizeof(pk_act));
    f->buf.exact = 0;
}

static void fixture_free(struct fixture *f) {
    threadpool_free(f->pool);
    free(f->buf.dequant); free(f->buf.xq); free(f->buf.xpk);
}

// out of matmul_many(W, x) for T tokens against the double reference, which takes x quantised
// per 32 (as the path being checked does) or as it is.
static void check_rows(struct fixture *f, int32_t type, int64_t cols, int T, int exact,
                       enum matmul_short_rows short_rows, int quantised) {
    const int64_t row_bytes = type_row_bytes(type, cols);
    uint8_t *data = malloc((size_t)(row_bytes * ROWS));
    float *w = malloc(sizeof(float) * (size_t)(cols * ROWS)), *x = malloc(sizeof(float) * (size_t)(cols * T));
    float *out = malloc(sizeof(float) * (size_t)(ROWS * T));
    block_q8_act *xq = malloc(Q8_ACT_BYTES(cols));
    for (int i = 0; i < ROWS; i++) {
        random_row(type, data + i * row_bytes, cols);
        dequant_row(type, data + i * row_bytes, w + i * cols, cols);
    }
    for (int64_t i = 0; i < cols * T; i++) x[i] = uniform(-2, 2);
    const struct tensor t = { data, type, { cols, ROWS } }, *tp = &t;
    f->buf.exact = exact;
    matmul_many(f->pool, 1, &out, &tp, x, T, &f->buf, short_rows);
    int bad = 0;
    for (int tok = 0; tok < T; tok++) {
        const float *xt = x + tok * cols;
        if (quantised) quantize_row_q8_act(xt, xq, cols);
        for (int i = 0; i < ROWS; i++) {
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < cols; k++) {
                const double xk = quantised ? (double)xq[k / 32].qs[k % 32] * xq[k / 32].d : (double)xt[k];
                const double term = (double)w[i * cols + k] * xk;
                ref += term;
                mag += fabs(term);
            }
            const double got = out[tok * ROWS + i], tol = 1e-5 * mag + 1e-30;
            bad += !(fabs(got - ref) <= tol);
            CHECK_NEAR(got, ref, tol);
        }
    }
    if (bad)
        fprintf(stderr, "  %s cols=%lld T=%d exact=%d short_rows=%d: %d bad\n", pykv_type_name(type), (long long)cols,
                T, exact, (int)short_rows, bad);
    free(data); free(w); free(x); free(out); free(xq);
}

// As matmul() calls it.
static void check_case(struct fixture *f, int32_t type, int64_t cols, int T, int exact, int quantised) {
    check_rows(f, type, cols, T, exact, MATMUL_SHORT_INT8, quantised);
}

// Decode on 1, 2 and 3 threads: matrices of whole groups of four rows (the four-row kernel's
// unit) give the same bits on any number of threads, and each row matches the one-row kernel.
static void check_threads_same(void) {
    enum { COLS = 576, N_MAT = 3 };
    const int rows[N_MAT] = { 40, 24, 12 };
    const int64_t rb = type_row_bytes(PYKV_TYPE_Q4_1, COLS);
    uint8_t *data[N_MAT];
    struct tensor t[N_MAT];
    const struct tensor *tp[N_MAT];
    float x[COLS], out[3][N_MAT][40];
    block_q8_act xq[Q8_ACT_BLOCKS(COLS)];
    for (int64_t k = 0; k < COLS; k++) x[k] = uniform(-2, 2);
    quantize_row_q8_act(x, xq, COLS);
    for (int m = 0; m < N_MAT; m++) {
        data[m] = malloc((size_t)(rb * rows[m]));
        for (int i = 0; i < rows[m]; i++) random_row(PYKV_TYPE_Q4_1, data[m] + i * rb, COLS);
        t[m] = (struct tensor){ data[m], PYKV_TYPE_Q4_1, { COLS, rows[m] } };
        tp[m] = &t[m];
    }
    for (int n_threads = 1; n_threads <= 3; n_threads++) {
        struct fixture f;
        fixture_init(&f, COLS, 1, n_threads);
        float *outs[N_MAT] = { out[n_threads - 1][0], out[n_threads - 1][1], out[n_threads - 1][2] };
        matmul_many(f.pool, N_MAT, outs, tp, x, 1, &f.buf, MATMUL_SHORT_INT8);
        fixture_free(&f);
    }
    for (int m = 0; m < N_MAT; m++)
        for (int i = 0; i < rows[m]; i++) {
            CHECK(out[1][m][i] == out[0][m][i]);
            CHECK(out[2][m][i] == out[0][m][i]);
            const float one = vec_dot_q8_for(PYKV_TYPE_Q4_1)(data[m] + i * rb, xq, COLS);
            CHECK_NEAR(out[0][m][i], one, 1e-5 * (fabs(one) + 1.0));
        }
    for (int m = 0; m < N_MAT; m++) free(data[m]);
}

int main(void) {
    check_threads_same();
    struct fixture f;
    fixture_init(&f, 1024, 29, 2);
    // The last three only where the VNNI kernel runs (gemm-q8.h); the float GEMM elsewhere, below.
    const int32_t packed[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q4_K,
                               PYKV_TYPE_Q6_K, PYKV_TYPE_Q8_0, PYKV_TYPE_IQ4_NL, PYKV_TYPE_IQ4_XS };
    const size_t n_packed = sizeof packed / sizeof packed[0] - (gemm_q8_has_vnni() ? 0 : 3);
    const int64_t widths[] = { 512, 768, 576, 160, 96, 32 };   // the last four: the 32-element types
    for (size_t i = 0; i < n_packed; i++)
        for (size_t j = 0; j < sizeof widths / sizeof widths[0]; j++) {
            const int32_t type = packed[i];
            const int64_t cols = widths[j];
            if (cols % PK_ELEMS && type_traits_of(type)->block_size == PK_ELEMS) continue;
            CHECK(gemm_q8_supports(type, cols));
            check_case(&f, type, cols, 29, 0, 1);   // prefill: the integer GEMM
            check_case(&f, type, cols, 7, 0, 1);
            check_case(&f, type, cols, 1, 0, 1);    // decode
            check_case(&f, type, cols, 7, 1, 0);    // exact: float, prefill and decode
            check_case(&f, type, cols, 1, 1, 0);
        }
    // MATMUL_SHORT_FLOAT (q/k/v): a prefill keeps rows that end short in float, not whole ones.
    check_rows(&f, PYKV_TYPE_Q4_1, 576, 29, 0, MATMUL_SHORT_FLOAT, 0);
    check_rows(&f, PYKV_TYPE_Q5_0, 160, 7, 0, MATMUL_SHORT_FLOAT, 0);
    check_rows(&f, PYKV_TYPE_Q4_1, 576, 1, 0, MATMUL_SHORT_FLOAT, 1);   // decode quantises
    check_rows(&f, PYKV_TYPE_Q4_1, 512, 29, 0, MATMUL_SHORT_FLOAT, 1);
    check_rows(&f, PYKV_TYPE_Q4_K, 768, 29, 0, MATMUL_SHORT_FLOAT, 1);
    // Types the integer GEMM leaves to the float one: decode still quantises Q8_0.
    const int64_t float_widths[] = { 512, 576 };
    for (size_t j = 0; j < sizeof float_widths / sizeof float_widths[0]; j++) {
        if (!gemm_q8_has_vnni()) {
            CHECK(!gemm_q8_supports(PYKV_TYPE_Q8_0, float_widths[j]));
            check_case(&f, PYKV_TYPE_Q8_0, float_widths[j], 29, 0, 0);
            check_case(&f, PYKV_TYPE_Q8_0, float_widths[j], 1, 0, 1);
        }
        CHECK(!gemm_q8_supports(PYKV_TYPE_F16, float_widths[j]));
        check_case(&f, PYKV_TYPE_F16, float_widths[j], 29, 0, 0);
    }
    fixture_free(&f);
    return check_report("test_matmul");
}
