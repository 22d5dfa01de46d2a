// test_quant.c - fp16/bf16 conversion, dequantization and the vec_dot kernels.
//
// For every type, random but valid rows (random bytes with finite f16 scales written over
// the scale fields) are checked three ways: the dispatched (SIMD) vec_dot, the scalar
// vec_dot and a double-precision dot of dequant_row's output must agree within
// 1e-5 * sum(|w_i * x_i|). Float sums in a different order differ by a few ulps of that
// sum; 1e-5 is ~170 ulps, far below any real layout bug (which shows up as O(1) relative).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "random-rows.h"
#include "core/error.h"
#include "cpu/quant-blocks.h"
#include "model/types.h"

static const int32_t all_types[] = {
    PYKV_TYPE_F32, PYKV_TYPE_F16, PYKV_TYPE_BF16, PYKV_TYPE_Q8_0, PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1,
    PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q2_K, PYKV_TYPE_Q3_K, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K,
    PYKV_TYPE_Q6_K, PYKV_TYPE_IQ4_NL, PYKV_TYPE_IQ4_XS,
};
#define N_TYPES (int)(sizeof(all_types) / sizeof(all_types[0]))

static void check_vec_dot(int32_t type, int64_t n) {
    uint8_t *row = malloc((size_t)type_row_bytes(type, n));
    float *x = malloc((size_t)n * sizeof(float)), *w = malloc((size_t)n * sizeof(float));
    for (int rep = 0; rep < 4; rep++) {
        random_row(type, row, n);
        for (int64_t i = 0; i < n; i++) x[i] = uniform(-2, 2);
        CHECK(dequant_row(type, row, w, n) == PYKV_OK);
        double ref = 0, mag = 0;
        for (int64_t i = 0; i < n; i++) { ref += (double)w[i] * x[i]; mag += fabs((double)w[i] * x[i]); }
        const double tol = 1e-5 * mag + 1e-30;
        const float simd = vec_dot_for(type)(row, x, n);
        const float scal = vec_dot_scalar_for(type)(row, x, n);
        CHECK(isfinite(mag) && mag > 0);
        CHECK_NEAR(simd, ref, tol);
        CHECK_NEAR(scal, ref, tol);
        CHECK_NEAR(simd, scal, tol);
        if (!(fabs(simd - ref) <= tol)) fprintf(stderr, "  type %s n=%lld\n", pykv_type_name(type), (long long)n);
    }
    free(row); free(x); free(w);
}

static void test_vec_dot(void) {
    for (int k = 0; k < N_TYPES; k++) {
        const int32_t type = all_types[k];
        const int bs = pykv_type_block_size(type);
        CHECK(vec_dot_for(type) != NULL);
        CHECK(vec_dot_scalar_for(type) != NULL);
        if (bs == 1) {
            const int64_t ns[] = { 1, 7, 37, 576, 1536 };   // odd lengths reach the tail loops
            for (int i = 0; i < 5; i++) check_vec_dot(type, ns[i]);
        } else if (bs == 32) {
            const int64_t ns[] = { 32, 64, 96, 576, 1536 }; // odd block counts for Q8_0's pairs
            for (int i = 0; i < 5; i++) check_vec_dot(type, ns[i]);
        } else {
            const int64_t ns[] = { 256, 768, 1536 };
            for (int i = 0; i < 3; i++) check_vec_dot(type, ns[i]);
        }
    }
    CHECK(vec_dot_for(99) == NULL);
    CHECK(vec_dot_for(4) == NULL);   // a retired ggml type number
    CHECK(vec_dot_for(-1) == NULL);
    CHECK(vec_dot_scalar_for(99) == NULL);
}

// Hand-built blocks with known values, independent of the kernels' own helpers.
static void test_known_blocks(void) {
    float y[QK_K];
    block_q4_0 b40 = { .d = 0x3C00 };   // d = 1
    memset(b40.qs, 0x00, sizeof(b40.qs));
    b40.qs[0] = 0xF3;                   // element 0: 3-8, element 16: 15-8
    CHECK(dequant_row(PYKV_TYPE_Q4_0, &b40, y, 32) == PYKV_OK);
    CHECK(y[0] == -5.0f && y[16] == 7.0f && y[1] == -8.0f);

    block_q4_1 b41 = { .d = 0x3800, .m = 0xC000 };   // d = 0.5, m = -2
    memset(b41.qs, 0, sizeof(b41.qs));
    b41.qs[15] = 0x4A;                  // element 15: 10, element 31: 4
    CHECK(dequant_row(PYKV_TYPE_Q4_1, &b41, y, 32) == PYKV_OK);
    CHECK(y[15] == 3.0f && y[31] == 0.0f && y[0] == -2.0f);

    block_q5_0 b50 = { .d = 0x3C00, .qh = { 0x01, 0, 0, 0x80 } };   // bits 0 and 31
    memset(b50.qs, 0, sizeof(b50.qs));
    CHECK(dequant_row(PYKV_TYPE_Q5_0, &b50, y, 32) == PYKV_OK);
    CHECK(y[0] == 0.0f && y[31] == 0.0f && y[1] == -16.0f && y[16] == -16.0f);

    block_q8_0 b8 = { .d = 0x3800 };
    memset(b8.qs, 0, sizeof(b8.qs));
    b8.qs[0] = -128; b8.qs[31] = 127;
    CHECK(dequant_row(PYKV_TYPE_Q8_0, &b8, y, 32) == PYKV_OK);
    CHECK(y[0] == -64.0f && y[31] == 63.5f);

    // Q4_K: sub-block 5 takes scale (scales[9] & 15) | (scales[1] >> 6) << 4 and min
    // (scales[9] >> 4) | (scales[5] >> 6) << 4.
    block_q4_K bk;
    memset(&bk, 0, sizeof(bk));
    bk.d = 0x3C00; bk.dmin = 0x3C00;
    bk.scales[1] = 0x40; bk.scales[5] = 0x80; bk.scales[9] = 0x32;   // scale 16+2, min 32+3
    bk.qs[64 + 0] = 0x70;               // sub-block 5 = high nibbles of qs[64..95]: element 160 = 7
    CHECK(dequant_row(PYKV_TYPE_Q4_K, &bk, y, 256) == PYKV_OK);
    CHECK(y[160] == 18.0f * 7 - 35.0f && y[161] == -35.0f && y[0] == 0.0f);

    // Q6_K: element 64+l of the first half = high nibble of ql[l] | qh bits 4-5, scale 4 + l/16.
    block_q6_K b6;
    memset(&b6, 0, sizeof(b6));
    b6.d = 0x3C00;
    b6.scales[5] = -2;
    b6.ql[17] = 0x90; b6.qh[17] = 0x30; // q = 9 | 3<<4 = 57 -> 25
    CHECK(dequant_row(PYKV_TYPE_Q6_K, &b6, y, 256) == PYKV_OK);
    CHECK(y[64 + 17] == -50.0f && y[64 + 16] == 64.0f);

    CHECK(dequant_row(99, &b8, y, 32) == PYKV_ERR_UNSUPPORTED);
}

static void test_fp16(void) {
    struct { float f; uint16_t h; } known[] = {
        { 0.0f, 0x0000 }, { -0.0f, 0x8000 }, { 1.0f, 0x3C00 }, { -2.0f, 0xC000 }, { 0.5f, 0x3800 },
        { 65504.0f, 0x7BFF }, { 0x1p-14f, 0x0400 }, { 0x1p-24f, 0x0001 }, { 0x3FFp-24f, 0x03FF },
        { 0.333251953125f, 0x3555 }, { INFINITY, 0x7C00 }, { -INFINITY, 0xFC00 },
    };
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
        CHECK(fp32_to_fp16(known[i].f) == known[i].h);
        CHECK(f2u(fp16_to_fp32(known[i].h)) == f2u(known[i].f));
    }
    // Rounding: to nearest, ties to even; overflow to inf; underflow to zero.
    CHECK(fp32_to_fp16(1.0f + 0x1p-11f) == 0x3C00);       // tie, down to even
    CHECK(fp32_to_fp16(1.0f + 3 * 0x1p-11f) == 0x3C02);   // tie, up to even
    CHECK(fp32_to_fp16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3C01);
    CHECK(fp32_to_fp16(65519.0f) == 0x7BFF);
    CHECK(fp32_to_fp16(65520.0f) == 0x7C00);
    CHECK(fp32_to_fp16(1e10f) == 0x7C00 && fp32_to_fp16(-1e10f) == 0xFC00);
    CHECK(fp32_to_fp16(0x1p-25f) == 0x0000);               // tie with 0, to even
    CHECK(fp32_to_fp16(0x3p-26f) == 0x0001);               // 1.5 * 2^-25
    CHECK(fp32_to_fp16(0x3p-25f) == 0x0002);               // 1.5 * 2^-24, tie up to even
    CHECK(fp32_to_fp16(-1e-30f) == 0x8000);
    CHECK(fp32_to_fp16(0x7FFp-25f) == 0x0400);             // rounds up into the smallest normal
    const uint16_t hn = fp32_to_fp16(NAN);
    CHECK((hn & 0x7C00) == 0x7C00 && (hn & 0x3FF) != 0);
    CHECK(isnan(fp16_to_fp32(0x7E00)) && isnan(fp16_to_fp32(0xFC01)));
    CHECK(isnan(fp16_to_fp32(fp32_to_fp16(u2f(0x7F800001)))));   // signalling payload stays nan

    // Every half survives a round trip (NaNs as NaNs).
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = fp16_to_fp32((uint16_t)h);
        if (isnan(f)) bad += !isnan(fp16_to_fp32(fp32_to_fp16(f)));
        else bad += fp32_to_fp16(f) != h;
    }
    CHECK(bad == 0);

#ifdef __FLT16_MAX__
    // The compiler's own _Float16 conversion as an independent reference on random floats.
    int mism = 0;
    for (int i = 0; i < 1000000; i++) {
        // Exponents from 2^-30 (below the subnormals) to 2^17 (past the overflow); every
        // fourth value is an exact tie in the 13 dropped bits.
        uint32_t bits = (next_u32() & 0x80000000u) | (97u + next_u32() % 48u) << 23 | (next_u32() & 0x7FFFFFu);
        if (i % 4 == 0) bits = (bits & ~0x1FFFu) | 0x1000u;
        const float f = u2f(bits);
        const _Float16 r = (_Float16)f;
        uint16_t rb; memcpy(&rb, &r, 2);
        mism += fp32_to_fp16(f) != rb;
    }
    CHECK(mism == 0);
#endif

    CHECK(bf16_to_fp32(0x3F80) == 1.0f);
    CHECK(bf16_to_fp32(0xC000) == -2.0f);
    CHECK(bf16_to_fp32(0x7F80) == INFINITY && bf16_to_fp32(0xFF80) == -INFINITY);
    CHECK(isnan(bf16_to_fp32(0x7FC0)));
    CHECK(bf16_to_fp32(0x0001) == 0x1p-133f);   // subnormal
}

// The row conversions (F16C where available, used by the KV cache) give the scalar bits for
// every finite half and for a spread of floats: normal, subnormal, overflowing, ties.
static void test_fp16_rows(void) {
    enum { N = 4096 };
    static float f[N], back[N];
    static uint16_t h[N], ref[N];
    for (uint32_t start = 0; start < 0x10000; start += N) {
        int n = 0;
        for (uint32_t b = start; b < start + N; b++)
            if (((b >> 10) & 0x1F) != 0x1F) ref[n++] = (uint16_t)b;   // finite halves
        fp16_to_fp32_row(ref, back, n);
        for (int i = 0; i < n; i++) CHECK(f2u(back[i]) == f2u(fp16_to_fp32(ref[i])));
    }
    for (int i = 0; i < N; i++) {
        const float mag = (float)pow(2.0, -30.0 + 50.0 * (double)(next_u32() & 0xFFFF) / 65536.0);
        f[i] = (next_u32() & 1 ? -mag : mag) * (i % 7 == 0 ? 1.0f : uniform(0.5f, 1.0f));
        if (i % 11 == 0) f[i] = fp16_to_fp32((uint16_t)(next_u32() & 0x7BFF)) + 0.5f * 0x1p-24f;   // near ties
    }
    fp32_to_fp16_row(f, h, N);
    for (int i = 0; i < N; i++) CHECK(h[i] == fp32_to_fp16(f[i]));
}

static void test_f32_kernels(void) {
    float a[1537], b[1537], y1[1537], y2[1537];
    for (int i = 0; i < 1537; i++) { a[i] = uniform(-1, 1); b[i] = uniform(-1, 1); }
    const int ns[] = { 0, 1, 7, 8, 15, 33, 576, 1537 };
    for (int k = 0; k < 8; k++) {
        const int n = ns[k];
        double ref = 0, mag = 0;
        for (int i = 0; i < n; i++) { ref += (double)a[i] * b[i]; mag += fabs((double)a[i] * b[i]); }
        CHECK_NEAR(dot_f32(a, b, n), ref, 1e-5 * mag + 1e-30);
        CHECK_NEAR(quant_scalar_kernels.dot_f32(a, b, n), ref, 1e-5 * mag + 1e-30);
        memcpy(y1, b, sizeof(b));
        memcpy(y2, b, sizeof(b));
        axpy_f32(y1, 0.75f, a, n);
        quant_scalar_kernels.axpy_f32(y2, 0.75f, a, n);
        int bad = 0;
        for (int i = 0; i < 1537; i++) bad += fabsf(y1[i] - y2[i]) > 1e-6f;   // FMA vs mul+add
        CHECK(bad == 0);
    }
}

static void test_pykv_dequantize(void) {
    _Alignas(16) uint8_t row[2 * 210 + 1] = { 0 };
    float y1[512], y2[512];
    CHECK(pykv_dequantize(99, row, 32, y1) == PYKV_ERR_UNSUPPORTED);
    CHECK(strstr(pykv_last_error(), "99") != NULL);
    CHECK(pykv_dequantize(PYKV_TYPE_Q4_0, row, 33, y1) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "block size 32") != NULL);
    CHECK(pykv_dequantize(PYKV_TYPE_Q4_0, row, -32, y1) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_dequantize(PYKV_TYPE_Q4_0, NULL, 32, y1) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "NULL src") != NULL);
    CHECK(pykv_dequantize(PYKV_TYPE_Q4_0, row, 32, NULL) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_dequantize(PYKV_TYPE_Q4_0, NULL, 0, NULL) == PYKV_OK);
    // An odd source address gives the same values as an aligned one.
    for (int k = 0; k < N_TYPES; k++) {
        const int32_t type = all_types[k];
        const int64_t n = pykv_type_block_size(type) == 256 ? 512 : 64;
        random_row(type, row, n);
        memmove(row + 1, row, (size_t)type_row_bytes(type, n));
        _Alignas(16) uint8_t aligned[2 * 210];
        memcpy(aligned, row + 1, (size_t)type_row_bytes(type, n));
        CHECK(pykv_dequantize(type, row + 1, n, y1) == PYKV_OK);
        CHECK(pykv_dequantize(type, aligned, n, y2) == PYKV_OK);
        CHECK(memcmp(y1, y2, (size_t)n * sizeof(float)) == 0);
    }
}

int main(void) {
    printf("quant simd: %s\n", quant_simd_name());
    CHECK(quant_simd_name() != NULL);
    test_fp16();
    test_known_blocks();
    test_vec_dot();
    test_f32_kernels();
    test_fp16_rows();
    test_pykv_dequantize();
    return check_report("test_quant");
}
