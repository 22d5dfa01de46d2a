// test_gemm_q8.c - prefill's integer GEMM (gemm-q8.h): packing and the products.
//
// Each product must equal (within float rounding, 1e-5 * sum|terms|) a double dot of the
// dequantized weights with the activations quantised as the decode step quantises them
// (quantize_row_q8_act, turned back into q * d): the activation quantisation is the only
// approximation. The scalar reference, the AVX2 kernel, the VNNI kernel (where the CPU has
// it, for the unit-scale types) and the choice between them are held to that, each, on shapes
// with rows and tokens left over from the kernels' tiles, and for the 32-element types on rows
// that end in a short super-block of each padded width. The 8-bit types (Q8_0, IQ4) are
// packed for the VNNI kernel only: the scalar reference is checked on them everywhere.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu/gemm-q8.h"
#include "cpu/quant-blocks.h"
#include "random-rows.h"

static const int32_t packed_types[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1,
                                        PYKV_TYPE_Q2_K, PYKV_TYPE_Q3_K, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K,
                                        PYKV_TYPE_Q6_K, PYKV_TYPE_Q8_0, PYKV_TYPE_IQ4_NL, PYKV_TYPE_IQ4_XS };

// The kernels a type's packed rows go to: scalar, AVX2, VNNI, the dispatcher.
enum { K_SCALAR, K_AVX2, K_VNNI, K_CHOSEN, N_KERNELS };
static const char *const kernel_names[N_KERNELS] = { "scalar", "avx2", "vnni", "chosen" };

// How many products each kernel gave (0: not on this CPU), reported at the end.
static int kernel_runs[N_KERNELS];

// out[k] for each kernel k that runs here (ran[k] = 1); the others are left alone.
static void run_kernels(int32_t type, const pk_weight *pw, int n_rows, const pk_act *px, int T, int64_t cols,
                        float *const out[N_KERNELS], int ran[N_KERNELS]) {
    gemm_q8_rows_scalar(pw, n_rows, px, T, cols, out[K_SCALAR], n_rows);
    ran[K_SCALAR] = 1;
    ran[K_AVX2] = gemm_q8_rows_avx2(pw, n_rows, px, T, cols, gemm_q8_run(type), out[K_AVX2], n_rows);
    ran[K_VNNI] = gemm_q8_unit_scales(type) && gemm_q8_rows_vnni(pw, n_rows, px, T, cols, out[K_VNNI], n_rows);
    ran[K_CHOSEN] = gemm_q8_supports(type, cols);
    if (ran[K_CHOSEN]) gemm_q8_rows(pw, n_rows, px, T, cols, type, out[K_CHOSEN], n_rows);
    for (int k = 0; k < N_KERNELS; k++) kernel_runs[k] += ran[k];
}

static void random_activations(float *x, int64_t n, int t) {
    for (int64_t i = 0; i < n; i++) x[i] = uniform(-3, 3);
    if (t == 1) for (int64_t i = 32; i < 64 && i < n; i++) x[i] = 0.0f;   // an all-zero group
    if (t == 2) for (int64_t i = 0; i < n; i++) x[i] = i % 7 == 0 ? 100.0f : 0.01f;   // peaked groups
}

// Products of n_rows random rows of `type` with T random tokens, against the double reference.
static void check_products(int32_t type, int64_t cols, int n_rows, int T) {
    const int64_t n_super = pk_blocks(cols), row_bytes = type_row_bytes(type, cols);
    uint8_t *rows = malloc((size_t)(row_bytes * n_rows));
    float *w = malloc(sizeof(float) * (size_t)(cols * n_rows)), *x = malloc(sizeof(float) * (size_t)(cols * T));
    pk_weight *pw = malloc(sizeof(pk_weight) * (size_t)(n_super * n_rows));
    pk_act *px = malloc(sizeof(pk_act) * (size_t)(n_super * T));
    block_q8_act *xq = malloc(Q8_ACT_BYTES(cols));
    float *got[N_KERNELS];
    int ran[N_KERNELS];
    for (int k = 0; k < N_KERNELS; k++) got[k] = malloc(sizeof(float) * (size_t)(n_rows * T));
    for (int i = 0; i < n_rows; i++) {
        random_row(type, rows + i * row_bytes, cols);
        CHECK(dequant_row(type, rows + i * row_bytes, w + i * cols, cols) == PYKV_OK);
        pack_weight_row(type, rows + i * row_bytes, pw + i * n_super, cols);
    }
    for (int t = 0; t < T; t++) random_activations(x + t * cols, cols, t);
    pack_act_rows(x, T, cols, px);
    run_kernels(type, pw, n_rows, px, T, cols, got, ran);
    int bad[N_KERNELS] = { 0 };
    for (int t = 0; t < T; t++) {
        quantize_row_q8_act(x + t * cols, xq, cols);
        for (int i = 0; i < n_rows; i++) {
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < cols; k++) {
                const double term = (double)w[i * cols + k] * xq[k / 32].qs[k % 32] * xq[k / 32].d;
                ref += term;
                mag += fabs(term);
            }
            const double tol = 1e-5 * mag + 1e-30;
            for (int k = 0; k < N_KERNELS; k++)
                if (ran[k]) {
                    bad[k] += !(fabs(got[k][t * n_rows + i] - ref) <= tol);
                    CHECK_NEAR(got[k][t * n_rows + i], ref, tol);
                }
        }
    }
    for (int k = 0; k < N_KERNELS; k++)
        if (bad[k])
            fprintf(stderr, "  %s: type %s cols=%lld rows=%d T=%d\n", kernel_names[k], pykv_type_name(type),
                    (long long)cols, n_rows, T);
    free(rows); free(w); free(x); free(pw); free(px); free(xq);
    for (int k = 0; k < N_KERNELS; k++) free(got[k]);
}

// The 8-bit types: packed only where the VNNI kernel runs.
static int wide_type(int32_t type) {
    return type == PYKV_TYPE_Q8_0 || type == PYKV_TYPE_IQ4_NL || type == PYKV_TYPE_IQ4_XS;
}

static void test_products(void) {
    for (size_t i = 0; i < sizeof packed_types / sizeof packed_types[0]; i++) {
        const int32_t type = packed_types[i];
        CHECK(gemm_q8_supports(type, 512) == (!wide_type(type) || gemm_q8_has_vnni()));
        if (wide_type(type)) CHECK(gemm_q8_run(type) == 0 && gemm_q8_unit_scales(type));
        else                 CHECK(gemm_q8_run(type) >= 2 && gemm_q8_run(type) <= 8);
        check_products(type, 256, 5, 7);
        check_products(type, 768, 4, 6);
        check_products(type, 512, 1, 1);
        check_products(type, 1024, 13, 29);   // tiles of rows and tokens, and both left over
    }
    const int32_t small_block_types[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1,
                                          PYKV_TYPE_Q8_0, PYKV_TYPE_IQ4_NL };
    const int64_t short_widths[] = { 576, 32, 64, 96, 128, 160, 224, 288, 800 };
    for (size_t i = 0; i < sizeof small_block_types / sizeof small_block_types[0]; i++)
        for (size_t j = 0; j < sizeof short_widths / sizeof short_widths[0]; j++) {
            CHECK(gemm_q8_supports(small_block_types[i], short_widths[j]) ==
                  (!wide_type(small_block_types[i]) || gemm_q8_has_vnni()));
            check_products(small_block_types[i], short_widths[j], 5, 7);
        }
}

static int largest_quant(int32_t type) {
    switch (type) {
    case PYKV_TYPE_Q8_0: return 255;
    case PYKV_TYPE_IQ4_NL: case PYKV_TYPE_IQ4_XS: return 241;
    case PYKV_TYPE_Q6_K: return 63;
    case PYKV_TYPE_Q5_0: case PYKV_TYPE_Q5_1: case PYKV_TYPE_Q5_K: return 31;
    case PYKV_TYPE_Q3_K: return 7;
    case PYKV_TYPE_Q2_K: return 3;
    default: return 15;
    }
}

// The largest quants against the largest activations: the int16 sums of an AVX2 run stay in
// range, and so do the VNNI kernel's int32 ones.
static void test_extremes(void) {
    for (size_t i = 0; i < sizeof packed_types / sizeof packed_types[0]; i++) {
        const int32_t type = packed_types[i];
        const int64_t cols = 256;
        uint8_t row[sizeof(block_q8_0) * 8];
        float x[256];
        pk_weight pw;
        pk_act px;
        random_row(type, row, cols);
        pack_weight_row(type, row, &pw, cols);
        const int qmax = largest_quant(type);
        CHECK(2 * 127 * qmax * gemm_q8_run(type) <= 32767);
        memset(pw.q, qmax, sizeof pw.q);
        for (int sign = -1; sign <= 1; sign += 2) {
            for (int k = 0; k < cols; k++) x[k] = (float)sign;
            pack_act_rows(x, 1, cols, &px);
            float got[N_KERNELS];
            float *out[N_KERNELS] = { got + K_SCALAR, got + K_AVX2, got + K_VNNI, got + K_CHOSEN };
            int ran[N_KERNELS];
            run_kernels(type, &pw, 1, &px, 1, cols, out, ran);
            double ref = 0;   // every quant at its largest, every activation +-127 * d
            for (int g = 0; g < 8; g++)
                for (int p = 2 * g; p < 2 * g + 2; p++)
                    ref += (double)px.dx[g] * (pw.dw[g] * (double)pw.sc[p] * pw.q[0] * 16 * 127 * sign -
                                               pw.dm[g] * (double)pw.mn[p] * px.bsum[p]);
            for (int k = 0; k < N_KERNELS; k++)
                if (ran[k]) CHECK_NEAR(got[k], ref, 1e-5 * fabs(ref) + 1e-6);
        }
    }
}

// Packed activations: the group scales and quants are quantize_row_q8_act's, in gemm-q8.h's
// lane order for each super-block (m lanes per sub-block: 1 for a whole one; 4 for the short
// 64 of 576), the padding of a short one zero, its scales spread over the lanes.
static void check_pack_act(int64_t cols) {
    float x[576];
    block_q8_act q[Q8_ACT_BLOCKS(576)];
    pk_act p[3];
    random_activations(x, cols, 0);
    quantize_row_q8_act(x, q, cols);
    pack_act_rows(x, 1, cols, p);
    for (int64_t s = 0; s < pk_blocks(cols); s++) {
        const pk_act *a = p + s;
        const int n = cols - s * PK_ELEMS < PK_ELEMS ? (int)(cols - s * PK_ELEMS) : PK_ELEMS;
        const int m = PK_ELEMS / pk_tail_width(n), g0 = (int)(s * PK_ELEMS / 32);
        for (int v = 0; v < 8; v++)
            for (int b = 0; b < 32; b++) {
                const int L = b / 2, e = 16 * (L / m) + 2 * (m * v + L % m) + b % 2;
                CHECK(a->q[32 * v + b] == (e < n && v < 8 / m ? q[g0 + e / 32].qs[e % 32] : 0));
            }
        for (int k = 0; k < 8; k++) CHECK(a->dx[k] == q[g0 + k / m].d);
        for (int L = 0; L < 16; L++) {
            int sum = 0;
            for (int w = 0; w < 16; w++) sum += q[g0 + L / (2 * m)].qs[(16 * (L / m) + w) % 32];
            CHECK(a->bsum[L] == (L % m == 0 ? sum : 0));
        }
    }
}

static void test_pack_act(void) {
    check_pack_act(512);
    check_pack_act(576);
}

static void test_supports(void) {
    CHECK(!gemm_q8_supports(PYKV_TYPE_Q4_K, 576));   // K-quant rows are whole super-blocks
    CHECK(gemm_q8_supports(PYKV_TYPE_Q4_1, 288));     // a short last super-block
    CHECK(!gemm_q8_supports(PYKV_TYPE_Q4_1, 48));     // not whole blocks of 32
    CHECK(!gemm_q8_supports(PYKV_TYPE_IQ4_XS, 288));  // whole super-blocks
    CHECK(!gemm_q8_unit_scales(PYKV_TYPE_Q6_K) && !gemm_q8_unit_scales(PYKV_TYPE_Q2_K));
    CHECK(!gemm_q8_supports(PYKV_TYPE_F16, 256));
    CHECK(!gemm_q8_supports(PYKV_TYPE_F32, 256));
    CHECK(gemm_q8_run(PYKV_TYPE_F32) == 0);
    CHECK(pk_blocks(576) == 3 && pk_tail_width(576) == 64 && pk_tail_width(512) == 256);
    CHECK(pk_tail_width(96) == 128 && pk_tail_width(32) == 32 && pk_tail_width(224) == 256);
}

int main(void) {
    test_pack_act();
    test_products();
    test_extremes();
    test_supports();
    for (int k = 0; k < N_KERNELS; k++) printf("test_gemm_q8: %s kernel: %d runs\n", kernel_names[k], kernel_runs[k]);
    CHECK(kernel_runs[K_VNNI] > 0 || !gemm_q8_has_vnni());
    return check_report("test_gemm_q8");
}
