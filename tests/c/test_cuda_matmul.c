// ctest-label: cuda
// test_cuda_matmul.c - the CUDA matrix kernels (ggml-cuda/matvec.cu, matmul.cu, get-rows.cu)
// against the CPU for every weight type they take, on shapes with tails in T and in rows.
//
// out = x . dequant(W)^T is computed in double from pykv_dequantize's weights. Each path's
// result is compared to it by NMSE = sum((a - b)^2) / sum(b^2):
//   - cuda_matvec_q8, quantised types: x goes to 8 bits per block of 32 (step d = max|x| / 127,
//     error variance d^2 / 12, a few 1e-5 of a normal x's variance): 5e-4, as ggml's
//     test-backend-ops for 8-bit activation products. Its activations are the CPU's bit for
//     bit, so it is also held to the CPU's own integer dot (vec_dot_q8_scalar) within float
//     summation order, 1e-9.
//   - cuda_matvec_q8, F32/F16/BF16: float sums, 1e-7 (and 1e-9 against the CPU's float dot).
//   - cuda_matmul_mma: x and W rounded to f16 (unit roundoff u = 2^-11, relative variance u^2 / 3
//     each, so about 2e-7 in all) with f32 accumulation: 1e-5.
//   - cuda_matmul: whichever of the two it picks for T.
// cuda_get_rows must give exactly pykv_dequantize's values.
// Needs a GPU: exits 77 (skipped) without one.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/quant-q8.h"
#include "cpu/quant.h"
#include "ggml-cuda/kernels.h"
#include "model/types.h"
#include "random-rows.h"
#define CUDA_CHECK_RANDOM_ROWS
#include "cuda-check.h"

#define NMSE_Q8      5e-4
#define NMSE_FLOAT   1e-7
#define NMSE_TWIN    1e-9
#define NMSE_MMA     1e-5

static const int32_t TYPES[] = { PYKV_TYPE_F32, PYKV_TYPE_F16, PYKV_TYPE_BF16, PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1,
                                 PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q8_0, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K,
                                 PYKV_TYPE_Q6_K };

struct shape { int64_t cols, rows; int T; };
static const struct shape SHAPES[] = {
    { 256, 17, 1 },    { 576, 576, 1 },  { 576, 1536, 3 },  { 1536, 576, 8 },  { 4096, 64, 1 },
    { 768, 100, 9 },   { 576, 1536, 64 }, { 576, 49, 130 },  { 4096, 300, 512 }, { 96, 33, 5 },
    { 768, 7, 2 },     { 14336, 40, 4 },  { 1536, 129, 16 }, { 32, 1, 1 },      { 256, 65, 65 },
    // float types only (cols not a whole number of blocks of 32)
    { 100, 37, 3 },    { 1000, 70, 70 },  { 17, 5, 9 },
};

static int is_float_type(int32_t type) {
    return type == PYKV_TYPE_F32 || type == PYKV_TYPE_F16 || type == PYKV_TYPE_BF16;
}

// One path's output, downloaded and compared.
static double run_path(const char *path, int32_t type, const struct shape *sh, const float *d_out, float *out,
                       const double *ref, double thr) {
    const int64_t n = (int64_t)sh->T * sh->rows;
    if (!fetch(out, d_out, (size_t)n * sizeof(float), path)) return NAN;
    const double e = nmse_d(out, ref, n);
    const struct type_traits *tt = type_traits_of(type);
    printf("%-5s cols=%-5lld rows=%-5lld T=%-4d %-10s NMSE %.3e (max %.0e)%s\n", tt->name, (long long)sh->cols,
           (long long)sh->rows, sh->T, path, e, thr, e <= thr ? "" : "  FAIL");
    CHECK(e <= thr);
    return e;
}

// The CPU's twin of the few-row path: its 8-bit activations and integer dots (quantised
// types) or its float dots.
static void cpu_twin(int32_t type, const uint8_t *w, int64_t row_bytes, int64_t cols, int64_t rows, const float *x,
                     int T, double *twin) {
    block_q8_act *xq = malloc(Q8_ACT_BLOCKS(cols) * sizeof(block_q8_act));
    const vec_dot_q8_fn q8 = is_float_type(type) ? NULL : vec_dot_q8_scalar_for(type);
    const vec_dot_fn fl = vec_dot_scalar_for(type);
    for (int t = 0; t < T; t++) {
        if (q8) quantize_row_q8_act_scalar(x + t * cols, xq, cols);
        for (int64_t r = 0; r < rows; r++)
            twin[t * rows + r] = q8 ? q8(w + r * row_bytes, xq, cols) : fl(w + r * row_bytes, x + t * cols, cols);
    }
    free(xq);
}

static void test_case(int32_t type, const struct shape *sh) {
    const int64_t cols = sh->cols, rows = sh->rows;
    const int T = sh->T;
    const int64_t row_bytes = type_row_bytes(type, cols);
    if (row_bytes < 0) return;   // cols is not a whole number of this type's blocks
    if (!is_float_type(type) && cols % 32 != 0) return;
    const int few = T <= 2 * CUDA_MATVEC_MAX_T;   // the few-row path is run (the second batch reuses work)

    uint8_t *w = malloc((size_t)(row_bytes * rows));
    float *wf = malloc((size_t)(cols * rows) * sizeof(float));
    float *x = malloc((size_t)(cols * T) * sizeof(float));
    double *ref = malloc((size_t)(T * rows) * sizeof(double));
    double *twin = malloc((size_t)(T * rows) * sizeof(double));
    float *out = malloc((size_t)(T * rows) * sizeof(float));
    for (int64_t r = 0; r < rows; r++) random_row(type, w + r * row_bytes, cols);
    for (int64_t r = 0; r < rows; r++) CHECK(pykv_dequantize(type, w + r * row_bytes, cols, wf + r * cols) == PYKV_OK);
    random_x(x, cols, T);
    for (int t = 0; t < T; t++)
        for (int64_t r = 0; r < rows; r++) {
            double s = 0.0;
            for (int64_t c = 0; c < cols; c++) s += (double)x[t * cols + c] * wf[r * cols + c];
            ref[t * rows + r] = s;
        }
    if (few) cpu_twin(type, w, row_bytes, cols, rows, x, T, twin);
    // The 8-bit path's bound: NMSE_Q8 against the exact product, or 1.5x the CPU's own 8-bit
    // error where that is larger (a product of a few 32-value dots, whose error an NMSE bound
    // meant for whole rows does not cover).
    double q8_thr = NMSE_Q8;
    if (few && !is_float_type(type)) {
        double num = 0.0, den = 0.0;
        for (int64_t i = 0; i < (int64_t)T * rows; i++) {
            num += (twin[i] - ref[i]) * (twin[i] - ref[i]);
            den += ref[i] * ref[i];
        }
        const double cpu_err = den > 0.0 ? num / den : num;
        if (1.5 * cpu_err > q8_thr) q8_thr = 1.5 * cpu_err;
    }

    void *d_w = NULL, *d_work = NULL;
    float *d_x = NULL, *d_out = NULL;
    const size_t out_bytes = (size_t)(T * rows) * sizeof(float);
    if (!ok(cuda_alloc(&d_w, (size_t)(row_bytes * rows), "W"), "alloc") ||
        !ok(cuda_alloc((void **)&d_x, (size_t)(cols * T) * sizeof(float), "x"), "alloc") ||
        !ok(cuda_alloc((void **)&d_out, out_bytes, "out"), "alloc") ||
        !ok(cuda_alloc(&d_work, cuda_matmul_work_bytes(cols, T), "work"), "alloc"))
        goto done;
    if (!ok(cuda_upload(d_w, w, (size_t)(row_bytes * rows)), "upload") ||
        !ok(cuda_upload(d_x, x, (size_t)(cols * T) * sizeof(float)), "upload"))
        goto done;

    // Every path starts from an output of NaNs (all bits set), so one it leaves unwritten fails.
    if (few) {
        ok(cuda_memset(d_out, 0xFF, out_bytes, NULL), "memset");
        cuda_matvec_q8(NULL, d_out, d_w, type, cols, rows, d_x, T, d_work);
        run_path("matvec_q8", type, sh, d_out, out, ref, is_float_type(type) ? NMSE_FLOAT : q8_thr);
        const double e = nmse_d(out, twin, (int64_t)T * rows);
        if (!(e <= NMSE_TWIN)) printf("      matvec_q8 vs the CPU's %s dot: NMSE %.3e  FAIL\n", is_float_type(type) ? "float" : "q8", e);
        CHECK(e <= NMSE_TWIN);
    }
    ok(cuda_memset(d_out, 0xFF, out_bytes, NULL), "memset");
    cuda_matmul_mma(NULL, d_out, d_w, type, cols, rows, d_x, T, d_work);
    run_path("matmul_mma", type, sh, d_out, out, ref, NMSE_MMA);

    ok(cuda_memset(d_out, 0xFF, out_bytes, NULL), "memset");
    cuda_matmul(NULL, d_out, d_w, type, cols, rows, d_x, T, d_work);
    const double thr = T > CUDA_MATVEC_MAX_T ? NMSE_MMA : is_float_type(type) ? NMSE_FLOAT : q8_thr;
    run_path("matmul", type, sh, d_out, out, ref, thr);

    // In two steps, the work buffer staged once and read twice (the forward pass's q, k, v):
    // both products are cuda_matmul's, bit for bit.
    float *one = malloc((size_t)(T * rows) * sizeof(float));
    memcpy(one, out, (size_t)(T * rows) * sizeof(float));
    int64_t differ = 0;
    ok(cuda_memset(d_work, 0xFF, cuda_matmul_work_bytes(cols, T), NULL), "memset");
    cuda_matmul_stage(NULL, d_work, d_x, cols, T);
    for (int k = 0; k < 2; k++) {
        ok(cuda_memset(d_out, 0xFF, out_bytes, NULL), "memset");
        cuda_matmul_staged(NULL, d_out, d_w, type, cols, rows, d_x, T, d_work);
        run_path(k ? "staged (again)" : "staged", type, sh, d_out, out, ref, thr);
        for (int64_t i = 0; i < (int64_t)T * rows; i++) differ += memcmp(&out[i], &one[i], sizeof(float)) != 0;
    }
    if (differ) printf("      staged products: %lld outputs differ from cuda_matmul's  FAIL\n", (long long)differ);
    CHECK(differ == 0);
    free(one);

done:
    cuda_free(d_w);
    cuda_free(d_x);
    cuda_free(d_out);
    cuda_free(d_work);
    free(w);
    free(wf);
    free(x);
    free(ref);
    free(twin);
    free(out);
}

// cuda_get_rows: n_ids rows (repeats, the first and the last among them), exactly.
static void test_get_rows(int32_t type, int64_t cols, int64_t rows, int n_ids) {
    const int64_t row_bytes = type_row_bytes(type, cols);
    if (row_bytes < 0) return;
    uint8_t *w = malloc((size_t)(row_bytes * rows));
    float *ref = malloc((size_t)(cols * n_ids) * sizeof(float));
    float *out = malloc((size_t)(cols * n_ids) * sizeof(float));
    int32_t *ids = malloc((size_t)n_ids * sizeof(int32_t));
    for (int64_t r = 0; r < rows; r++) random_row(type, w + r * row_bytes, cols);
    for (int i = 0; i < n_ids; i++) {
        ids[i] = i == 0 ? (int32_t)(rows - 1) : i == 1 ? 0 : (int32_t)(next_u32() % (uint32_t)rows);
        CHECK(pykv_dequantize(type, w + ids[i] * row_bytes, cols, ref + i * cols) == PYKV_OK);
    }
    void *d_w = NULL;
    float *d_out = NULL;
    int32_t *d_ids = NULL;
    int64_t bad = -1;
    if (ok(cuda_alloc(&d_w, (size_t)(row_bytes * rows), "W"), "alloc") &&
        ok(cuda_alloc((void **)&d_out, (size_t)(cols * n_ids) * sizeof(float), "out"), "alloc") &&
        ok(cuda_alloc((void **)&d_ids, (size_t)n_ids * sizeof(int32_t), "ids"), "alloc") &&
        ok(cuda_upload(d_w, w, (size_t)(row_bytes * rows)), "upload") &&
        ok(cuda_upload(d_ids, ids, (size_t)n_ids * sizeof(int32_t)), "upload") &&
        ok(cuda_memset(d_out, 0xFF, (size_t)(cols * n_ids) * sizeof(float), NULL), "memset")) {
        cuda_get_rows(NULL, d_out, d_w, type, cols, d_ids, n_ids);
        if (fetch(out, d_out, (size_t)(cols * n_ids) * sizeof(float), "get_rows")) {
            bad = 0;
            for (int64_t i = 0; i < cols * n_ids; i++) bad += !(out[i] == ref[i]);   // NaN (unwritten) counts
        }
    }
    printf("%-5s cols=%-5lld rows=%-5lld T=%-4d get_rows   %lld of %lld values differ\n", type_traits_of(type)->name,
           (long long)cols, (long long)rows, n_ids, (long long)bad, (long long)(cols * n_ids));
    CHECK(bad == 0);
    cuda_free(d_w);
    cuda_free(d_out);
    cuda_free(d_ids);
    free(w);
    free(ref);
    free(out);
    free(ids);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Speeds on a model-sized matrix, for information (no checks): the few-row path's weight
// bandwidth and the tensor-core path's throughput.
static void report_speed(int32_t type, int64_t cols, int64_t rows) {
    const int64_t row_bytes = type_row_bytes(type, cols);
    const int T_big = 512;
    void *d_w = NULL, *d_work = NULL;
    float *d_x = NULL, *d_out = NULL;
    if (ok(cuda_alloc(&d_w, (size_t)(row_bytes * rows), "W"), "alloc") &&
        ok(cuda_alloc((void **)&d_x, (size_t)(cols * T_big) * sizeof(float), "x"), "alloc") &&
        ok(cuda_alloc((void **)&d_out, (size_t)(rows * T_big) * sizeof(float), "out"), "alloc") &&
        ok(cuda_alloc(&d_work, cuda_matmul_work_bytes(cols, T_big), "work"), "alloc") &&
        ok(cuda_memset(d_w, 0x11, (size_t)(row_bytes * rows), NULL), "memset") &&
        ok(cuda_memset(d_x, 0, (size_t)(cols * T_big) * sizeof(float), NULL), "memset")) {
        const int Ts[] = { 1, CUDA_MATVEC_MAX_T, T_big };
        for (int k = 0; k < 3; k++) {
            const int T = Ts[k], iters = T == T_big ? 5 : 50;
            cuda_matmul(NULL, d_out, d_w, type, cols, rows, d_x, T, d_work);
            ok(cuda_stream_sync(NULL), "warm-up");
            const double t0 = now_s();
            for (int i = 0; i < iters; i++) cuda_matmul(NULL, d_out, d_w, type, cols, rows, d_x, T, d_work);
            ok(cuda_stream_sync(NULL), "timing");
            const double dt = (now_s() - t0) / iters;
            printf("speed %-5s %lldx%lld T=%-3d %8.1f us  %7.1f GB/s of weights  %6.2f TFLOP/s\n", type_traits_of(type)->name,
                   (long long)rows, (long long)cols, T, dt * 1e6, (double)(row_bytes * rows) / dt * 1e-9,
                   2.0 * (double)cols * (double)rows * T / dt * 1e-12);
        }
    }
    cuda_free(d_w);
    cuda_free(d_x);
    cuda_free(d_out);
    cuda_free(d_work);
}

int main(void) {
    if (!cuda_test_start("test_cuda_matmul")) return CHECK_SKIP;
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++) {
        CHECK(cuda_matmul_supported(TYPES[i]));
        for (size_t j = 0; j < sizeof(SHAPES) / sizeof(SHAPES[0]); j++) test_case(TYPES[i], &SHAPES[j]);
        test_get_rows(TYPES[i], 2048, 300, 7);
        test_get_rows(TYPES[i], 768, 5, 70000);   // more tokens than a grid's y dimension
        test_get_rows(TYPES[i], 100, 9, 3);       // float types only
    }
    const struct shape many = { 64, 3, 70000 };   // more activation rows than a grid's y dimension
    test_case(PYKV_TYPE_Q8_0, &many);
    CHECK(!cuda_matmul_supported(PYKV_TYPE_Q2_K));
    CHECK(!cuda_matmul_supported(PYKV_TYPE_IQ4_XS));
    report_speed(PYKV_TYPE_Q4_K, 4096, 14336);
    report_speed(PYKV_TYPE_Q8_0, 4096, 4096);
    report_speed(PYKV_TYPE_F16, 4096, 4096);
    return check_report("test_cuda_matmul");
}
