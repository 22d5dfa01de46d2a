// test_quant_q8.c - the fast decode path: 8-bit activation quantisation and the integer dot
// products of each weight type with it.
//
// The integer kernels must equal (within float rounding, 1e-5 * sum|terms|) a double dot of
// the dequantised weights with the dequantised activations q * d: the quantisation is the
// only approximation, and it is bounded separately (|x - q d| <= d / 2 per element).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "quant-blocks.h"
#include "quant-q8.h"
#include "random-rows.h"

static void random_activations(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = uniform(-3, 3);
    for (int64_t i = 0; i < n && n >= 64; i++) if (i / 32 == 1) x[i] = 0.0f;   // an all-zero block
    if (n >= 96) for (int j = 64; j < 96; j++) x[j] = (float)(j % 5 - 2) * 0.5f;   // exact halves: ties
}

static void test_quantize(void) {
    const int64_t n = 1536;
    float *x = malloc(n * sizeof(float));
    block_q8_act *a = malloc(n / 32 * sizeof(*a)), *b = malloc(n / 32 * sizeof(*b));
    for (int rep = 0; rep < 20; rep++) {
        random_activations(x, n);
        quantize_row_q8_act_scalar(x, a, n);
        quantize_row_q8_act(x, b, n);
        CHECK(memcmp(a, b, n / 32 * sizeof(*a)) == 0);   // SIMD and scalar give the same bits
        for (int64_t i = 0; i < n / 32; i++) {
            int sum = 0, amax = 0;
            for (int j = 0; j < 32; j++) {
                const float xi = x[i * 32 + j];
                const int q = a[i].qs[j];
                sum += q;
                if (abs(q) > amax) amax = abs(q);
                CHECK(fabsf(xi - (float)q * a[i].d) <= 0.5f * a[i].d * 1.0001f);
            }
            CHECK(amax <= 127);
            CHECK(a[i].d == 0.0f || amax == 127);   // the largest element maps to +-127
            CHECK(a[i].s == a[i].d * (float)sum);
        }
    }
    free(x); free(a); free(b);
}

static const int32_t q8_types[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q8_0,
                                    PYKV_TYPE_Q2_K, PYKV_TYPE_Q3_K, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K, PYKV_TYPE_Q6_K,
                                    PYKV_TYPE_IQ4_NL, PYKV_TYPE_IQ4_XS };

static void check_dot(int32_t type, int64_t n) {
    uint8_t *row = malloc((size_t)type_row_bytes(type, n));
    float *x = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
    block_q8_act *xq = malloc(n / 32 * sizeof(*xq));
    for (int rep = 0; rep < 4; rep++) {
        random_row(type, row, n);
        random_activations(x, n);
        quantize_row_q8_act(x, xq, n);
        CHECK(dequant_row(type, row, w, n) == PYKV_OK);
        double ref = 0, mag = 0, exact = 0, qerr = 0;
        for (int64_t i = 0; i < n; i++) {
            const double xd = (double)xq[i / 32].qs[i % 32] * xq[i / 32].d;
            ref += (double)w[i] * xd;
            mag += fabs((double)w[i] * xd);
            exact += (double)w[i] * x[i];
            qerr += fabs((double)w[i]) * 0.5 * xq[i / 32].d;
        }
        const double tol = 1e-5 * mag + 1e-30;
        const float simd = vec_dot_q8_for(type)(row, xq, n);
        const float scal = vec_dot_q8_scalar_for(type)(row, xq, n);
        CHECK_NEAR(simd, ref, tol);
        CHECK_NEAR(scal, ref, tol);
        CHECK_NEAR(simd, exact, qerr + tol);   // against float activations: the quantisation bound
        if (!(fabs(simd - ref) <= tol)) fprintf(stderr, "  type %s n=%lld\n", pykv_type_name(type), (long long)n);
    }
    free(row); free(x); free(w); free(xq);
}

static void test_dots(void) {
    const int64_t ns[] = { 32, 64, 96, 576, 1536 };   // odd block counts reach the tail
    const int64_t ns_k[] = { 256, 768, 1536, 2816 };  // super-blocks of 256
    for (size_t k = 0; k < sizeof(q8_types) / sizeof(q8_types[0]); k++) {
        CHECK(vec_dot_q8_for(q8_types[k]) != NULL);
        CHECK(vec_dot_q8_scalar_for(q8_types[k]) != NULL);
        if (pykv_type_block_size(q8_types[k]) == 256)
            for (int i = 0; i < 4; i++) check_dot(q8_types[k], ns_k[i]);
        else
            for (int i = 0; i < 5; i++) check_dot(q8_types[k], ns[i]);
    }
    // Types without an integer kernel fall back to the float path.
    CHECK(vec_dot_q8_for(PYKV_TYPE_F32) == NULL);
    CHECK(vec_dot_q8_for(PYKV_TYPE_F16) == NULL);
    CHECK(vec_dot_q8_for(PYKV_TYPE_BF16) == NULL);
    CHECK(vec_dot_q8_for(-1) == NULL);
    CHECK(vec_dot_q8_for(99) == NULL);
}

// Q8_0 weights of -128 (outside what ggml writes, but valid bytes) must not overflow the
// 16-bit pair sums.
static void test_q8_0_extremes(void) {
    block_q8_0 b[2];
    block_q8_act x[2];
    float xf[64];
    for (int i = 0; i < 2; i++) {
        b[i].d = fp32_to_fp16(1.0f);
        for (int j = 0; j < 32; j++) b[i].qs[j] = -128;
    }
    for (int j = 0; j < 64; j++) xf[j] = -1.0f;
    quantize_row_q8_act(xf, x, 64);
    const double want = 64.0 * 128.0 * (127.0 * x[0].d);
    CHECK_NEAR(vec_dot_q8_for(PYKV_TYPE_Q8_0)(b, x, 64), want, 1e-3 * want);
    CHECK_NEAR(vec_dot_q8_scalar_for(PYKV_TYPE_Q8_0)(b, x, 64), want, 1e-3 * want);
}

int main(void) {
    test_quantize();
    test_dots();
    test_q8_0_extremes();
    return check_report("test_quant_q8");
}
