// ctest-label: cuda
// test_cuda_fused.c - the decode step's fused kernels (ggml-cuda/norm-quant.cu, matvec.cu):
// cuda_rmsnorm_q8_1, cuda_swiglu_q8_1, cuda_quantize_q8_1 and cuda_matvec_q8_pre, against the
// unfused kernels they replace and against the CPU, for every quantised weight type on the
// decode shapes of small and large models (cols x rows 576 x 1536, 1536 x 576, 4096 x 14336,
// 96 x 33) and T = 1, 3, 8 activation rows. For the RMSNorm path (x -> rmsnorm -> W) and
// the SwiGLU path (gate, up -> swiglu -> W) each:
//   (a) the fused kernel's Q8_1 blocks are cuda_rmsnorm's (cuda_swiglu's) floats through
//       cuda_quantize_q8_1, byte for byte; and those are the CPU's quantize_row_q8_act_scalar
//       of the same floats, byte for byte;
//   (c) cuda_matvec_q8_pre on the fused blocks equals cuda_matvec_q8 on the floats, bit for bit
//       (one kernel, the same blocks);
//   (d) with accumulate, onto an output already holding out0, it gives out0 + (c): NMSE 1e-12
//       (the one float addition is exact to rounding; the differing outputs are counted);
//   (e) (c) against the exact product of the CPU's rmsnorm_scalar (swiglu_scalar) floats with
//       the dequantised weights, in double: NMSE 5e-4, the 8-bit activation bound of ggml's
//       test-backend-ops (on 4096 x 14336 every 28th weight row, to keep the CPU's part short).
// Then rows with an inf and all zeros through the fused quantisers, T = 11 (two chunks of
// CUDA_MATVEC_MAX_T) through cuda_matvec_q8_pre, and the float types, which it leaves alone.
// Needs a GPU: exits 77 (skipped) without one.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/ops.h"
#include "cpu/quant-q8.h"
#include "cpu/quant.h"
#include "ggml-cuda/kernels.h"
#include "model/types.h"
#include "random-rows.h"
#define CUDA_CHECK_RANDOM_ROWS
#include "cuda-check.h"

#define NMSE_Q8  5e-4
#define NMSE_ACC 1e-12
#define EPS      1e-5f
#define Q8_1_BLOCK_BYTES 40   // a dev_block_q8_1: float d, float s, int8 qs[32]

static const int32_t TYPES[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1,
                                 PYKV_TYPE_Q8_0, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K, PYKV_TYPE_Q6_K };
struct shape { int64_t cols, rows; };
static const struct shape SHAPES[] = { { 576, 1536 }, { 1536, 576 }, { 4096, 14336 }, { 96, 33 } };
static const int TS[] = { 1, 3, 8 };

enum path { PATH_RMSNORM, PATH_SWIGLU };
static const char *PATH_NAME[] = { "rmsnorm", "swiglu" };

// How many of n blocks differ (bytes) between a and b.
static int64_t blocks_differ(const uint8_t *a, const uint8_t *b, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += memcmp(a + i * Q8_1_BLOCK_BYTES, b + i * Q8_1_BLOCK_BYTES, Q8_1_BLOCK_BYTES) != 0;
    return bad;
}

// The inputs of a path on the device: x and the norm's weight, or gate and up.
struct inputs {
    float *a, *b;        // host: x (T x cols) and w (cols), or gate and up (T x cols each)
    float *d_a, *d_b;    // device copies
};

// The floats the path feeds to the product, unfused on the device (d_f) and on the CPU (f).
static void path_floats_dev(enum path p, const struct inputs *in, float *d_f, int64_t cols, int T) {
    if (p == PATH_RMSNORM) cuda_rmsnorm(NULL, d_f, in->d_a, in->d_b, (int)cols, T, EPS);
    else                   cuda_swiglu(NULL, d_f, in->d_a, in->d_b, cols * T);
}
static void path_floats_cpu(enum path p, const struct inputs *in, float *f, int64_t cols, int T) {
    for (int t = 0; t < T; t++) {
        if (p == PATH_RMSNORM) rmsnorm_scalar(f + t * cols, in->a + t * cols, in->b, (int)cols, EPS);
        else                   swiglu_scalar(f + t * cols, in->a + t * cols, in->b + t * cols, (int)cols);
    }
}
static void path_fused(enum path p, const struct inputs *in, void *d_xq, int64_t cols, int T) {
    if (p == PATH_RMSNORM) cuda_rmsnorm_q8_1(NULL, d_xq, in->d_a, in->d_b, (int)cols, T, EPS);
    else                   cuda_swiglu_q8_1(NULL, d_xq, in->d_a, in->d_b, (int)cols, T);
}

// (a) of a path: the fused blocks against the unfused kernels' and the CPU's quantisation of
// the unfused floats. Leaves the floats in d_f and the fused blocks in d_xq.
static void check_blocks(enum path p, const struct inputs *in, int64_t cols, int T, float *d_f, void *d_xq,
                         void *d_xq_ref, const char *label) {
    const int64_t nb = cols / 32, n_blocks = nb * T;
    const size_t xq_bytes = cuda_q8_1_bytes(cols, T);
    uint8_t *got = malloc(xq_bytes), *want = malloc(xq_bytes);
    float *f = malloc((size_t)(cols * T) * sizeof(float));
    block_q8_act *cpu = malloc(Q8_ACT_BLOCKS(cols) * sizeof(block_q8_act));
    int64_t bad_fused = -1, bad_cpu = 0;

    path_floats_dev(p, in, d_f, cols, T);
    cuda_quantize_q8_1(NULL, d_xq_ref, d_f, cols, T);
    ok(cuda_memset(d_xq, 0xFF, xq_bytes, NULL), "memset");   // a block left unwritten differs
    path_fused(p, in, d_xq, cols, T);
    if (fetch(got, d_xq, xq_bytes, "fused") && fetch(want, d_xq_ref, xq_bytes, "unfused") &&
        fetch(f, d_f, (size_t)(cols * T) * sizeof(float), "floats")) {
        bad_fused = blocks_differ(got, want, n_blocks);
        for (int t = 0; t < T; t++) {
            quantize_row_q8_act_scalar(f + t * cols, cpu, cols);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *dev = want + (t * nb + b) * Q8_1_BLOCK_BYTES;
                const float d = ((const float *)dev)[0];
                const int both_nan = isnan(d) && isnan(cpu[b].d);   // non-finite blocks: any NaN
                bad_cpu += both_nan ? memcmp(dev + 8, cpu[b].qs, 32) != 0 : memcmp(dev, &cpu[b], Q8_1_BLOCK_BYTES) != 0;
            }
        }
    }
    printf("%-34s %-8s (a) fused vs unfused: %lld of %lld blocks differ; unfused vs the CPU's quantiser: %lld\n",
           label, PATH_NAME[p], (long long)bad_fused, (long long)n_blocks, (long long)bad_cpu);
    CHECK(bad_fused == 0);
    CHECK(bad_cpu == 0);
    free(got);
    free(want);
    free(f);
    free(cpu);
}

// One path of one case: (a), then (c), (d), (e) on weight W.
static void run_path(enum path p, int32_t type, const uint8_t *d_w, const float *wf, const int64_t *ref_rows,
                     int64_t n_ref, int64_t cols, int64_t rows, int T, const struct inputs *in) {
    const int64_t n_out = (int64_t)T * rows;
    const size_t out_bytes = (size_t)n_out * sizeof(float), xq_bytes = cuda_q8_1_bytes(cols, T);
    char label[96];
    snprintf(label, sizeof(label), "%-5s cols=%-5lld rows=%-5lld T=%d", type_traits_of(type)->name, (long long)cols,
             (long long)rows, T);
    float *d_f = dev_alloc((size_t)(cols * T) * sizeof(float));
    void *d_xq = dev_alloc(xq_bytes), *d_xq_ref = dev_alloc(xq_bytes);
    void *d_work = dev_alloc(cuda_matmul_work_bytes(cols, T));
    float *d_out = dev_alloc(out_bytes), *d_out_ref = dev_alloc(out_bytes);
    float *out = malloc(out_bytes), *out_ref = malloc(out_bytes), *out0 = malloc(out_bytes);
    float *f = malloc((size_t)(cols * T) * sizeof(float));
    double *want = malloc(out_bytes / sizeof(float) * sizeof(double));
    double *ref = malloc((size_t)(n_ref * T) * sizeof(double));
    float *got_ref = malloc((size_t)(n_ref * T) * sizeof(float));
    if (!d_f || !d_xq || !d_xq_ref || !d_work || !d_out || !d_out_ref) goto done;

    check_blocks(p, in, cols, T, d_f, d_xq, d_xq_ref, label);

    // (c): the product of the fused blocks against cuda_matvec_q8 of the floats. Both outputs
    // start as NaNs, so an output left unwritten fails.
    ok(cuda_memset(d_out_ref, 0xFF, out_bytes, NULL), "memset");
    ok(cuda_memset(d_out, 0xFF, out_bytes, NULL), "memset");
    cuda_matvec_q8(NULL, d_out_ref, d_w, type, cols, rows, d_f, T, d_work);
    cuda_matvec_q8_pre(NULL, d_out, d_w, type, cols, rows, d_xq, T, 0);
    if (!fetch(out_ref, d_out_ref, out_bytes, "matvec_q8") || !fetch(out, d_out, out_bytes, "matvec_q8_pre")) goto done;
    int64_t bad_c = 0, nan_c = 0;
    for (int64_t i = 0; i < n_out; i++) {
        bad_c += memcmp(&out[i], &out_ref[i], sizeof(float)) != 0;
        nan_c += isnan(out[i]);
    }
    CHECK(bad_c == 0);
    CHECK(nan_c == 0);

    // (d): accumulate onto out0.
    for (int64_t i = 0; i < n_out; i++) out0[i] = uniform(-3.0f, 3.0f);
    for (int64_t i = 0; i < n_out; i++) want[i] = (double)(out0[i] + out_ref[i]);
    if (!ok(cuda_upload(d_out, out0, out_bytes), "upload")) goto done;
    cuda_matvec_q8_pre(NULL, d_out, d_w, type, cols, rows, d_xq, T, 1);
    if (!fetch(out, d_out, out_bytes, "matvec_q8_pre accumulate")) goto done;
    int64_t bad_d = 0;
    for (int64_t i = 0; i < n_out; i++) bad_d += !((double)out[i] == want[i]);
    const double e_d = nmse_d(out, want, n_out);
    CHECK(e_d <= NMSE_ACC);

    // (e): the exact product of the CPU's floats on the reference rows.
    path_floats_cpu(p, in, f, cols, T);
    for (int t = 0; t < T; t++)
        for (int64_t k = 0; k < n_ref; k++) {
            const float *wr = wf + k * cols, *xr = f + t * cols;
            double s = 0.0;
            for (int64_t c = 0; c < cols; c++) s += (double)xr[c] * wr[c];
            ref[t * n_ref + k] = s;
            got_ref[t * n_ref + k] = out_ref[t * rows + ref_rows[k]];
        }
    const double e_e = nmse_d(got_ref, ref, n_ref * T);
    CHECK(e_e <= NMSE_Q8);
    printf("%-34s %-8s (c) pre vs matvec_q8: %lld of %lld differ; (d) accumulate NMSE %.2e (%lld not exact);"
           " (e) NMSE %.3e on %lld rows%s\n",
           label, PATH_NAME[p], (long long)bad_c, (long long)n_out, e_d, (long long)bad_d, e_e, (long long)n_ref,
           bad_c || e_d > NMSE_ACC || !(e_e <= NMSE_Q8) ? "  FAIL" : "");

done:
    cuda_free(d_f);
    cuda_free(d_xq);
    cuda_free(d_xq_ref);
    cuda_free(d_work);
    cuda_free(d_out);
    cuda_free(d_out_ref);
    free(out);
    free(out_ref);
    free(out0);
    free(f);
    free(want);
    free(ref);
    free(got_ref);
}

// Random inputs of a path for T rows of cols, uploaded.
static int make_inputs(enum path p, struct inputs *in, int64_t cols, int T) {
    const int64_t n = cols * T;
    in->a = malloc((size_t)n * sizeof(float));
    in->b = malloc((size_t)(p == PATH_RMSNORM ? cols : n) * sizeof(float));
    if (p == PATH_RMSNORM) {
        random_x(in->a, cols, T);
        for (int64_t c = 0; c < cols; c++) in->b[c] = uniform(0.5f, 1.5f);
    } else {
        for (int64_t i = 0; i < n; i++) in->a[i] = uniform(-6.0f, 4.0f);
        random_x(in->b, cols, T);
    }
    const size_t b_bytes = (size_t)(p == PATH_RMSNORM ? cols : n) * sizeof(float);
    in->d_a = dev_alloc((size_t)n * sizeof(float));
    in->d_b = dev_alloc(b_bytes);
    return in->d_a && in->d_b && ok(cuda_upload(in->d_a, in->a, (size_t)n * sizeof(float)), "upload") &&
           ok(cuda_upload(in->d_b, in->b, b_bytes), "upload");
}
static void free_inputs(struct inputs *in) {
    free(in->a);
    free(in->b);
    cuda_free(in->d_a);
    cuda_free(in->d_b);
}

// One weight type and shape: W made once, every T and both paths on it.
static void test_case(int32_t type, int64_t cols, int64_t rows, const int *Ts, int n_Ts) {
    const int64_t row_bytes = type_row_bytes(type, cols);
    if (row_bytes <= 0 || cols % type_traits_of(type)->block_size != 0) return;   // not rows of this type
    const int64_t stride = rows > 2048 ? rows / 512 : 1;
    const int64_t n_ref = (rows + stride - 1) / stride;
    uint8_t *w = malloc((size_t)(row_bytes * rows));
    int64_t *ref_rows = malloc((size_t)n_ref * sizeof(int64_t));
    float *wf = malloc((size_t)(n_ref * cols) * sizeof(float));
    for (int64_t r = 0; r < rows; r++) random_row(type, w + r * row_bytes, cols);
    for (int64_t k = 0; k < n_ref; k++) {
        ref_rows[k] = k * stride;
        CHECK(pykv_dequantize(type, w + ref_rows[k] * row_bytes, cols, wf + k * cols) == PYKV_OK);
    }
    uint8_t *d_w = dev_alloc((size_t)(row_bytes * rows));
    if (d_w && ok(cuda_upload(d_w, w, (size_t)(row_bytes * rows)), "upload W")) {
        for (int i = 0; i < n_Ts; i++)
            for (int p = PATH_RMSNORM; p <= PATH_SWIGLU; p++) {
                struct inputs in;
                if (make_inputs((enum path)p, &in, cols, Ts[i]))
                    run_path((enum path)p, type, d_w, wf, ref_rows, n_ref, cols, rows, Ts[i], &in);
                free_inputs(&in);
            }
    }
    cuda_free(d_w);
    free(w);
    free(ref_rows);
    free(wf);
}

// T = 3 rows: row 0 with an inf in its gate or x (its norm comes out NaN, and in SwiGLU the
// block holding it), row 1 with a NaN in its up (SwiGLU), row 2 all zeros in x or the gate:
// the fused blocks are still the unfused ones, and the CPU's quantisation of the same floats.
static void test_special_rows(int64_t cols) {
    const int T = 3;
    for (int p = PATH_RMSNORM; p <= PATH_SWIGLU; p++) {
        struct inputs in;
        in.a = malloc((size_t)(cols * T) * sizeof(float));
        in.b = malloc((size_t)(cols * T) * sizeof(float));
        random_x(in.a, cols, T);
        for (int64_t i = 0; i < cols * T; i++) in.b[i] = uniform(0.5f, 1.5f);
        in.a[cols / 2] = INFINITY;
        if (p == PATH_SWIGLU) in.b[cols + 3] = NAN;
        memset(in.a + 2 * cols, 0, (size_t)cols * sizeof(float));
        in.d_a = dev_alloc((size_t)(cols * T) * sizeof(float));
        in.d_b = dev_alloc((size_t)(cols * T) * sizeof(float));
        float *d_f = dev_alloc((size_t)(cols * T) * sizeof(float));
        void *d_xq = dev_alloc(cuda_q8_1_bytes(cols, T)), *d_xq_ref = dev_alloc(cuda_q8_1_bytes(cols, T));
        char label[64];
        snprintf(label, sizeof(label), "inf and zero rows cols=%lld T=%d", (long long)cols, T);
        if (in.d_a && in.d_b && d_f && d_xq && d_xq_ref &&
            ok(cuda_upload(in.d_a, in.a, (size_t)(cols * T) * sizeof(float)), "upload") &&
            ok(cuda_upload(in.d_b, in.b, (size_t)(cols * T) * sizeof(float)), "upload"))
            check_blocks((enum path)p, &in, cols, T, d_f, d_xq, d_xq_ref, label);
        cuda_free(d_f);
        cuda_free(d_xq);
        cuda_free(d_xq_ref);
        free_inputs(&in);
    }
}

// cuda_matvec_q8_pre leaves the output alone for a float weight type.
static void test_float_type_ignored(void) {
    const int64_t cols = 64, rows = 8;
    float *d_w = dev_alloc((size_t)(cols * rows) * sizeof(float)), *d_out = dev_alloc((size_t)rows * sizeof(float));
    void *d_xq = dev_alloc(cuda_q8_1_bytes(cols, 1));
    float out[8];
    int64_t changed = -1;
    if (d_w && d_out && d_xq && ok(cuda_memset(d_w, 0, (size_t)(cols * rows) * sizeof(float), NULL), "memset") &&
        ok(cuda_memset(d_xq, 0, cuda_q8_1_bytes(cols, 1), NULL), "memset") &&
        ok(cuda_memset(d_out, 0x7F, (size_t)rows * sizeof(float), NULL), "memset")) {
        cuda_matvec_q8_pre(NULL, d_out, d_w, PYKV_TYPE_F32, cols, rows, d_xq, 1, 0);
        cuda_matvec_q8_pre(NULL, d_out, d_w, PYKV_TYPE_F16, cols, rows, d_xq, 1, 1);
        if (fetch(out, d_out, sizeof(out), "float types")) {
            changed = 0;
            for (int i = 0; i < 8; i++) changed += f2u(out[i]) != 0x7F7F7F7Fu;
        }
    }
    printf("matvec_q8_pre on F32/F16 weights: %lld outputs changed\n", (long long)changed);
    CHECK(changed == 0);
    cuda_free(d_w);
    cuda_free(d_out);
    cuda_free(d_xq);
}

int main(void) {
    if (!cuda_test_start("test_cuda_fused")) return CHECK_SKIP;
    CHECK(cuda_q8_1_bytes(576, 3) == 3 * 18 * Q8_1_BLOCK_BYTES);
    CHECK(cuda_q8_1_bytes(576, 0) == 0);
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
        for (size_t j = 0; j < sizeof(SHAPES) / sizeof(SHAPES[0]); j++)
            test_case(TYPES[i], SHAPES[j].cols, SHAPES[j].rows, TS, 3);
    const int T_chunks[] = { 11 };   // more rows than CUDA_MATVEC_MAX_T: two chunks
    test_case(PYKV_TYPE_Q4_0, 96, 33, T_chunks, 1);
    test_case(PYKV_TYPE_Q6_K, 1536, 70, T_chunks, 1);
    test_special_rows(96);
    test_special_rows(8192);
    test_float_type_ignored();
    return check_report("test_cuda_fused");
}
