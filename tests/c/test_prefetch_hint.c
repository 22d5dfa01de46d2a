// test_prefetch_hint.c - the kernels compiled twice, with the non-temporal and with the T0
// weight prefetch (simd-avx2.h): both sets give the same bits, both match a double reference,
// and the dispatch hands Intel CPUs the T0 set and every other CPU the non-temporal one. The
// vendor is read from CPUID leaf 0 here, independently of the library's check.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu/quant-blocks.h"
#include "cpu/quant-q8.h"
#include "random-rows.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

#include "cpu/simd-avx2.h"

static const int32_t q8_types[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q8_0,
                                    PYKV_TYPE_Q2_K, PYKV_TYPE_Q3_K, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K, PYKV_TYPE_Q6_K,
                                    PYKV_TYPE_IQ4_NL, PYKV_TYPE_IQ4_XS };
static const int32_t float_types[] = { PYKV_TYPE_F32, PYKV_TYPE_F16, PYKV_TYPE_BF16, PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1,
                                       PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q8_0, PYKV_TYPE_Q2_K, PYKV_TYPE_Q3_K,
                                       PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K, PYKV_TYPE_Q6_K, PYKV_TYPE_IQ4_NL,
                                       PYKV_TYPE_IQ4_XS };

enum { N = 1536, ROWS = 4 };   // a multiple of every block size; four rows for the four-row kernels

static int is_intel(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    char vendor[13];
    memcpy(vendor, &b, 4);
    memcpy(vendor + 4, &d, 4);
    memcpy(vendor + 8, &c, 4);
    vendor[12] = '\0';
    return strcmp(vendor, "GenuineIntel") == 0;
}

static int same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

// The double dot of a dequantised row with y, and 1e-5 of the sum of the terms' magnitudes.
static double reference(int32_t type, const uint8_t *row, const double *y, double *tol) {
    float w[N];
    CHECK(dequant_row(type, row, w, N) == PYKV_OK);
    double sum = 0, mag = 0;
    for (int i = 0; i < N; i++) {
        sum += (double)w[i] * y[i];
        mag += fabs((double)w[i] * y[i]);
    }
    *tol = 1e-5 * mag + 1e-30;
    return sum;
}

static void test_integer_kernels(void) {
    float x[N];
    double xd[N];
    block_q8_act *xq = malloc(Q8_ACT_BYTES(N));
    for (int i = 0; i < N; i++) x[i] = uniform(-3, 3);
    quantize_row_q8_act(x, xq, N);
    for (int i = 0; i < N; i++) xd[i] = (double)xq[i / 32].qs[i % 32] * xq[i / 32].d;   // what the kernels see
    for (size_t k = 0; k < sizeof(q8_types) / sizeof(q8_types[0]); k++) {
        const int32_t type = q8_types[k];
        const int64_t rb = type_row_bytes(type, N);
        uint8_t *rows = malloc((size_t)(ROWS * rb));
        for (int r = 0; r < ROWS; r++) random_row(type, rows + r * rb, N);
        CHECK(q8_avx2_dots[type] && q8_avx2_dots_t0[type]);
        for (int r = 0; r < ROWS; r++) {
            double tol;
            const double ref = reference(type, rows + r * rb, xd, &tol);
            const float nta = q8_avx2_dots[type](rows + r * rb, xq, N), t0 = q8_avx2_dots_t0[type](rows + r * rb, xq, N);
            CHECK(same_bits(nta, t0));
            CHECK_NEAR(nta, ref, tol);
        }
        CHECK(!q8_avx2_dots4[type] == !q8_avx2_dots4_t0[type]);
        if (q8_avx2_dots4[type]) {
            float nta[ROWS], t0[ROWS];
            q8_avx2_dots4[type](rows, rb, xq, N, nta);
            q8_avx2_dots4_t0[type](rows, rb, xq, N, t0);
            for (int r = 0; r < ROWS; r++) {
                double tol;
                const double ref = reference(type, rows + r * rb, xd, &tol);
                CHECK(same_bits(nta[r], t0[r]));
                CHECK_NEAR(nta[r], ref, tol);
            }
        }
        free(rows);
    }
    free(xq);
}

static void test_float_kernels(void) {
    float x[N];
    double xd[N];
    for (int i = 0; i < N; i++) xd[i] = x[i] = uniform(-3, 3);
    for (size_t k = 0; k < sizeof(float_types) / sizeof(float_types[0]); k++) {
        const int32_t type = float_types[k];
        uint8_t *row = malloc((size_t)type_row_bytes(type, N));
        random_row(type, row, N);
        CHECK(quant_avx2_kernels.vec_dot[type] && quant_avx2_kernels_t0.vec_dot[type]);
        double tol;
        const double ref = reference(type, row, xd, &tol);
        const float nta = quant_avx2_kernels.vec_dot[type](row, x, N), t0 = quant_avx2_kernels_t0.vec_dot[type](row, x, N);
        CHECK(same_bits(nta, t0));
        CHECK_NEAR(nta, ref, tol);
        free(row);
    }
}

static void test_dispatch(void) {
    const int intel = is_intel();
    printf("vendor: %s, kernels: %s\n", intel ? "Intel" : "not Intel", quant_simd_name());
    for (size_t k = 0; k < sizeof(q8_types) / sizeof(q8_types[0]); k++) {
        const int32_t type = q8_types[k];
        CHECK(vec_dot_q8_for(type) == (intel ? q8_avx2_dots_t0 : q8_avx2_dots)[type]);
        CHECK(vec_dot4_q8_for(type) == (intel ? q8_avx2_dots4_t0 : q8_avx2_dots4)[type]);
    }
    for (size_t k = 0; k < sizeof(float_types) / sizeof(float_types[0]); k++) {
        const int32_t type = float_types[k];
        CHECK(vec_dot_for(type) == (intel ? quant_avx2_kernels_t0 : quant_avx2_kernels).vec_dot[type]);
    }
    CHECK((strstr(quant_simd_name(), "prefetch-t0") != NULL) == intel);
}

int main(void) {
    if (!cpu_has_avx2()) {
        printf("test_prefetch_hint: no AVX2 on this CPU, nothing to compare\n");
        return 0;
    }
    test_integer_kernels();
    test_float_kernels();
    test_dispatch();
    return check_report("test_prefetch_hint");
}
#else
int main(void) {
    printf("test_prefetch_hint: not an x86 build, nothing to compare\n");
    return 0;
}
#endif
