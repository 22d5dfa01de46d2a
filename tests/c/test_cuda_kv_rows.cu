// test_cuda_kv_rows.cu - the host twins of ggml-cuda/kv-rows.cuh (the device's KV row
// formats) against the CPU's cache, no GPU needed:
//  * float -> half bits against quant.c's fp32_to_fp16 and the F16C row conversion, on a
//    sweep of float bit patterns and on every tie between two adjacent halves (and a bit
//    either side), subnormal halves, overflow to inf, NaN payloads;
//  * rows stored by kv_store_row against the bytes kv_list_push leaves in a struct kv_list,
//    for each format as keys and as values: random rows, q8_0 values that round to ties,
//    q8_0 blocks with an inf, a NaN, all zeros, tiny values;
//  * kv_load against kv_key_f32 / kv_value_f32 (the CPU's dequantisation), bit for bit;
//  * the decode segments (attention-tile.cuh): a function of n alone, at most 64, never
//    empty, covering the list in order.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// kv-cache.h is C11: its counters are `_Atomic int64_t`, which C++ does not spell. A plain
// volatile int64_t has the same size and alignment, so the struct's layout is the C one
// (this file only passes the struct to the C functions and reads its lists).
#define _Atomic volatile
extern "C" {
#include "cpu/quant.h"
#include "kv/kv-cache.h"
}
#undef _Atomic

#include "ggml-cuda/attention-tile.cuh"
#include "ggml-cuda/kv-rows.cuh"

#define CUDA_CHECK_SEED 0x2545F4914F6CDD1Dull
#include "cuda-check.h"

static_assert(CUDA_KV_F32 == KV_F32 && CUDA_KV_F16 == KV_F16 && CUDA_KV_Q8_0 == KV_Q8_0, "the formats' numbers");
static_assert(CUDA_KV_Q8_BLOCK == KV_Q8_BLOCK && CUDA_KV_Q8_BLOCK_BYTES == KV_Q8_BLOCK_BYTES, "q8_0 blocks");

// ---- float -> half ----

static int f16_mismatches;
static void check_f16(float f) {
    const uint16_t want = fp32_to_fp16(f), got = kv_f32_to_f16_bits(f);
    if (want != got && f16_mismatches++ < 10)
        fprintf(stderr, "f16 of %08x: CPU %04x, kv-rows %04x\n", (unsigned)f2u(f), want, got);
}

static void test_f16_bits(void) {
    f16_mismatches = 0;
    long n = 0;
    for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 251, n++) check_f16(u2f((uint32_t)u));
    // every tie between adjacent halves (finite, both signs) and a float either side of it
    for (uint32_t h = 0; h < 0x7C00u; h++) {
        const float lo = fp16_to_fp32((uint16_t)h), hi = fp16_to_fp32((uint16_t)(h + 1));
        const float mid = (float)(((double)lo + (double)hi) / 2);   // exact: a half has 11 bits
        for (int sgn = 0; sgn < 2; sgn++) {
            const float m = sgn ? -mid : mid;
            check_f16(m);
            check_f16(nextafterf(m, 0.0f));
            check_f16(nextafterf(m, sgn ? -INFINITY : INFINITY));
            n += 3;
        }
    }
    const float special[] = { 0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.99f, 65520.0f, -65520.0f,
                              1e-8f, 2.98e-8f, 2.9802322e-8f, 5.96e-8f, 6.1035156e-5f, 6.1e-5f, 1e-40f, -1e-45f,
                              u2f(0x7F800001u), u2f(0xFFC12345u), u2f(0x7FBFFFFFu) };
    for (size_t i = 0; i < sizeof(special) / sizeof(special[0]); i++, n++) check_f16(special[i]);
    // the F16C row conversion (what kv_list_push uses on this CPU) agrees too
    float row[64];
    uint16_t a[64];
    int row_diff = 0;
    for (int rep = 0; rep < 2000; rep++) {
        for (int i = 0; i < 64; i++)   // exponents from below the subnormal halves to past inf
            row[i] = u2f((next_u32() & 0x807FFFFFu) | (100u + next_u32() % 46u) << 23);
        fp32_to_fp16_row(row, a, 64);
        for (int i = 0; i < 64; i++) row_diff += a[i] != kv_f32_to_f16_bits(row[i]);
    }
    CHECK(f16_mismatches == 0);
    CHECK(row_diff == 0);
    printf("f16 bits: %ld values, %d mismatches; F16C rows: %d mismatches\n", n, f16_mismatches, row_diff);
}

// ---- rows through kv_list_push ----

#define MAX_D 256

// Row kinds: 0 random in [-2, 2], 1 q8_0 ties (block max 127 or 63.5: scale 1 or 0.5, values
// k + 0.5 over the scale), 2 a block with +inf, 3 a NaN, 4 -inf and a NaN, 5 all zero,
// 6 tiny (the scale is a subnormal half), 7 f16 ties (midpoints between halves), 8 huge.
#define N_KINDS 9
static void make_row(float *x, int d, int kind) {
    for (int i = 0; i < d; i++) x[i] = uniform(-2.0f, 2.0f);
    switch (kind) {
    case 1:
        for (int b = 0; b < d / 32; b++) {
            const float s = b % 2 ? 0.5f : 1.0f;   // amax 127 s
            for (int i = 0; i < 32; i++) x[b * 32 + i] = s * ((float)((int)(next_u32() % 254) - 127) + 0.5f);
            x[b * 32 + (b % 32)] = (b & 2 ? -127.0f : 127.0f) * s;
        }
        break;
    case 2: x[d / 2 + 1] = INFINITY; break;
    case 3: x[3] = NAN; break;
    case 4: x[0] = -INFINITY; x[d - 1] = NAN; break;
    case 5: for (int i = 0; i < d; i++) x[i] = 0.0f; break;
    case 6: for (int i = 0; i < d; i++) x[i] *= 1e-6f; break;
    case 7:
        for (int i = 0; i < d; i++) {
            const uint16_t h = fp32_to_fp16(x[i]);
            x[i] = (float)(((double)fp16_to_fp32(h) + (double)fp16_to_fp32((uint16_t)(h + 1))) / 2);
        }
        break;
    case 8: for (int i = 0; i < d; i++) x[i] *= 40000.0f; break;
    default: break;
    }
}

// The stored bytes of every row pushed through the CPU's cache equal kv_store_row's, for
// keys in fmt_k and values in fmt_v; kv_load reads back what the CPU's accessors read.
static void test_rows(int fmt_k, int fmt_v, int d) {
    const int n = 3 * N_KINDS;
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 1, d, n, fmt_k, fmt_v) == PYKV_OK);
    struct kv_list *l = kv_cache_list(&c, 0, 0);
    CHECK(kv_list_reserve(&c, l, n) == PYKV_OK);
    static float ks[3 * N_KINDS][MAX_D], vs[3 * N_KINDS][MAX_D];
    for (int j = 0; j < n; j++) {
        make_row(ks[j], d, j % N_KINDS);
        make_row(vs[j], d, (j + 1) % N_KINDS);
        kv_list_push(&c, l, ks[j], vs[j], j);
    }
    int bad_bytes = 0, bad_loads = 0, loads = 0;
    uint8_t row[MAX_D * 4];
    float tmp[MAX_D];
    for (int j = 0; j < n; j++) {
        for (int is_v = 0; is_v < 2; is_v++) {
            const int fmt = is_v ? fmt_v : fmt_k;
            const size_t bytes = kv_row_bytes(fmt, d);
            CHECK(bytes == kv_format_row_bytes(fmt, d));
            memset(row, 0xA5, sizeof(row));
            kv_store_row(row, fmt, is_v ? vs[j] : ks[j], d);
            const void *cpu = is_v ? kv_value_row(l, j, d) : kv_key_row(l, j, d);
            if (memcmp(row, cpu, bytes) != 0) {
                if (bad_bytes < 5) {
                    size_t at = 0;
                    while (row[at] == ((const uint8_t *)cpu)[at]) at++;
                    fprintf(stderr, "%s/%s d=%d entry %d %s: byte %zu: kv-rows %02x, CPU %02x\n", kv_format_name(fmt_k),
                            kv_format_name(fmt_v), d, j, is_v ? "value" : "key", at, row[at], ((const uint8_t *)cpu)[at]);
                }
                bad_bytes++;
            }
            const float *ref = is_v ? kv_value_f32(l, j, d, tmp) : kv_key_f32(l, j, d, tmp);
            for (int i = 0; i < d; i++, loads++) {
                const float got = kv_load(cpu, fmt, i);
                const int same = f2u(got) == f2u(ref[i]) || (isnan(got) && isnan(ref[i]));
                bad_loads += !same;
            }
        }
    }
    CHECK(bad_bytes == 0);
    CHECK(bad_loads == 0);
    printf("rows k=%s v=%s d=%d: %d rows, %d byte mismatches; %d loads, %d mismatches\n", kv_format_name(fmt_k),
           kv_format_name(fmt_v), d, 2 * n, bad_bytes, loads, bad_loads);
    kv_cache_free(&c);
}

// A q8_0 block by hand: ties go to even, the scale is max|x| / 127 as a half.
static void test_q8_ties(void) {
    float x[32];
    for (int i = 0; i < 32; i++) x[i] = 0.0f;
    x[0] = 127.0f;   // scale 1
    x[1] = 2.5f; x[2] = 3.5f; x[3] = -2.5f; x[4] = -3.5f; x[5] = 0.5f; x[6] = -0.5f; x[7] = 126.5f; x[8] = 1.4999999f;
    uint8_t b[34];
    kv_store_q8_0_block(b, x);
    CHECK(b[0] == 0x00 && b[1] == 0x3C);   // half 1.0
    const int8_t want[9] = { 127, 2, 4, -2, -4, 0, 0, 126, 1 };
    for (int i = 0; i < 9; i++) CHECK((int8_t)b[2 + i] == want[i]);
    x[9] = NAN;
    kv_store_q8_0_block(b, x);
    CHECK(b[0] == 0x00 && b[1] == 0x3C && b[2 + 9] == 0 && (int8_t)b[2] == 127);   // NaN: 0, scale untouched
    x[10] = -INFINITY;
    kv_store_q8_0_block(b, x);
    CHECK(b[0] == 0x00 && b[1] == 0x7C);   // scale |-inf| / 127: +inf; every value x * 0 (or NaN): 0
    for (int i = 0; i < 32; i++) CHECK(b[2 + i] == 0);
}

// ---- decode segments ----

static void test_segments(void) {
    int bad = 0;
    for (int32_t n = 0; n <= 40000; n++) {
        const int s = cuda_attention_segments(n);
        if (s != attn_segments(n) || s < 1 || s > ATTN_MAX_SEGMENTS) { bad++; continue; }
        if (attn_segment_start(n, s, 0) != 0 || attn_segment_start(n, s, s) != n) bad++;
        for (int p = 0; p < s; p++) {
            const int len = attn_segment_start(n, s, p + 1) - attn_segment_start(n, s, p);
            if (len < (n ? 1 : 0) || len > (n + s - 1) / s) bad++;
        }
    }
    const int32_t big[] = { 131072, 131071, 1 << 20, 2147483647 };
    for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
        const int s = cuda_attention_segments(big[i]);
        CHECK(s == ATTN_MAX_SEGMENTS);
        CHECK(attn_segment_start(big[i], s, s) == big[i]);
        CHECK(attn_segment_start(big[i], s, s - 1) < big[i]);
    }
    CHECK(cuda_attention_segments(1) == 1 && cuda_attention_segments(64) == 1 && cuda_attention_segments(65) == 2);
    CHECK(bad == 0);
    printf("segments: n = 0..40000 and large, %d bad\n", bad);
}

int main(void) {
    test_f16_bits();
    test_q8_ties();
    const int dims[] = { 32, 64, 128, 256, 40, 8 };
    for (size_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++)
        for (int fk = 0; fk < KV_N_FORMATS; fk++)
            for (int fv = 0; fv < KV_N_FORMATS; fv++) {
                if ((fk == KV_Q8_0 || fv == KV_Q8_0) && dims[i] % 32) continue;
                test_rows(fk, fv, dims[i]);
            }
    test_segments();
    return check_report("test_cuda_kv_rows");
}
