// test_kv_cache.c - ragged per-head lists: append, retain (compaction), byte accounting,
// for floats and halves (the values used are exact in halves too), the accessors, and
// cutting every list back to a prefix of positions; Q8_0 storage against a quantizer
// written out here (scale max|x| / 127 as a half, values rounded to nearest even); the GPU
// rows an offloaded list takes.
#include "check.h"
#include "kv/kv-cache.h"
#include "cpu/quant.h"

#include <stdlib.h>
#include <string.h>

static void fill(float *x, int n, float v) { for (int i = 0; i < n; i++) x[i] = v + (float)i; }

static void check_type(int f16) {
    struct kv_cache c;
    const int hd = 8;
    CHECK(kv_cache_init(&c, 2, 3, hd, 1000, f16, f16) == PYKV_OK);
    CHECK(c.bytes == 0 && kv_cache_entries(&c) == 0);

    float k[8], v[8];
    struct kv_list *l = kv_cache_list(&c, 1, 2);
    CHECK(kv_list_reserve(&c, l, 100) == PYKV_OK);
    for (int i = 0; i < 100; i++) {
        fill(k, hd, (float)i);
        fill(v, hd, (float)-i);
        kv_list_push(&c, l, k, v, i);
    }
    const int64_t per_entry = 2 * hd * (f16 ? 2 : 4) + 4;
    CHECK(l->n == 100 && kv_cache_entries(&c) == 100);
    CHECK(c.bytes == (int64_t)l->cap * per_entry && c.peak_bytes == c.bytes);

    // keep every 10th entry: data and positions move down in order
    int32_t keep[10];
    for (int i = 0; i < 10; i++) keep[i] = i * 10;
    int64_t before = c.bytes;
    CHECK(kv_list_retain(&c, l, keep, 10) == PYKV_OK);
    CHECK(l->n == 10 && c.evicted == 90);
    CHECK(c.bytes < before && c.bytes == (int64_t)l->cap * per_entry);   // memory returned
    CHECK(c.peak_bytes == before);
    for (int i = 0; i < 10; i++) {
        CHECK(l->pos[i] == i * 10);
        float tk[8], tv[8], q[8] = { 0, 0, 0, 1, 0, 0, 0, 0 };
        CHECK(kv_key_f32(l, i, hd, tk)[3] == (float)(i * 10 + 3));
        CHECK(kv_value_f32(l, i, hd, tv)[1] == (float)(-(i * 10) + 1));
        CHECK(kv_key_dot(l, i, q, hd) == (float)(i * 10 + 3));
    }
    int32_t bad[2] = { 5, 3 };
    CHECK(kv_list_retain(&c, l, bad, 2) == PYKV_ERR_INTERNAL);   // not ascending

    // the limit per list is enforced
    CHECK(kv_list_reserve(&c, l, 991) == PYKV_ERR_CONTEXT_FULL);
    kv_list_truncate(&c, l, 4);
    CHECK(l->n == 4);

    kv_cache_clear(&c);
    CHECK(c.bytes == 0 && kv_cache_entries(&c) == 0 && c.evicted == 0);
    kv_cache_free(&c);
}

// kv_cache_keep_prefix: lists of different lengths (positions in order) keep what lies
// before the cut, their room shrinks to fit, nothing counts as evicted.
static void check_keep_prefix(int f16) {
    struct kv_cache c;
    const int hd = 4, n_lists = 2 * 2;
    CHECK(kv_cache_init(&c, 2, 2, hd, 1000, f16, f16) == PYKV_OK);
    float k[4], v[4];
    for (int i = 0; i < n_lists; i++) {
        struct kv_list *l = &c.lists[i];
        const int n = 50 * (i + 1);   // 50, 100, 150, 200 entries
        CHECK(kv_list_reserve(&c, l, n) == PYKV_OK);
        for (int j = 0; j < n; j++) {
            fill(k, hd, (float)j);
            fill(v, hd, (float)-j);
            kv_list_push(&c, l, k, v, j);
        }
    }
    const int64_t peak = c.peak_bytes;
    CHECK(kv_cache_keep_prefix(&c, 120) == PYKV_OK);
    const int64_t per_entry = 2 * hd * (f16 ? 2 : 4) + 4;
    int64_t held = 0;
    for (int i = 0; i < n_lists; i++) {
        const struct kv_list *l = &c.lists[i];
        const int want = 50 * (i + 1) < 120 ? 50 * (i + 1) : 120;
        CHECK(l->n == want);
        CHECK(l->cap <= want + want / 8 || l->cap <= 16);
        float tk[4];
        CHECK(l->pos[want - 1] == want - 1 && kv_key_f32(l, want - 1, hd, tk)[2] == (float)(want + 1));
        held += (int64_t)l->cap * per_entry;
    }
    CHECK(c.bytes == held && c.peak_bytes == peak && c.evicted == 0);
    CHECK(kv_cache_keep_prefix(&c, 5) == PYKV_OK);
    CHECK(kv_cache_entries(&c) == 5 * n_lists && c.lists[3].cap == 16);
    CHECK(kv_cache_keep_prefix(&c, 0) == PYKV_OK && kv_cache_entries(&c) == 0);
    kv_cache_free(&c);
}

// What a Q8_0 row of d values reads back as: per block of 32, s = half(max|x| / 127) and
// each value s * rint(x / (max|x| / 127)) (0 for an all-zero block).
static void q8_0_expected(const float *x, int d, float *out) {
    for (int b = 0; b < d; b += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(x[b + i]) > amax ? fabsf(x[b + i]) : amax;
        const float scale = amax / 127.0f, s = fp16_to_fp32(fp32_to_fp16(scale));
        for (int i = 0; i < 32; i++) out[b + i] = scale > 0.0f ? s * rintf(x[b + i] * (1.0f / scale)) : 0.0f;
    }
}

static void check_q8_0(void) {
    enum { HD = 64 };
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 2, 48, 100, KV_Q8_0, KV_Q8_0) == PYKV_ERR_INVALID_ARG);   // 48 is not whole blocks
    CHECK(kv_cache_init(&c, 1, 2, HD, 100, KV_Q8_0, KV_Q8_0) == PYKV_OK);
    CHECK(kv_cache_key_bytes(&c) == 2 * 34 && kv_cache_value_bytes(&c) == 2 * 34);
    struct kv_list *l = kv_cache_list(&c, 0, 1);
    CHECK(kv_list_reserve(&c, l, 40) == PYKV_OK);
    CHECK(c.bytes == (int64_t)l->cap * (2 * 68 + 4));
    float k[HD], v[HD], want[HD], tmp[HD], q[HD];
    srand(3);
    for (int j = 0; j < 40; j++) {
        for (int i = 0; i < HD; i++) {
            k[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * 20.0f;
            v[i] = j == 7 ? 0.0f : ((float)rand() / (float)RAND_MAX - 0.5f) * 0.01f;   // entry 7: all-zero value
        }
        kv_list_push(&c, l, k, v, j);
        q8_0_expected(k, HD, want);
        const float *got = kv_key_f32(l, j, HD, tmp);
        int same = 1;
        double dot = 0.0;
        for (int i = 0; i < HD; i++) {
            same &= got[i] == want[i];
            CHECK(fabsf(got[i] - k[i]) <= 10.0f / 127.0f * 0.57f);   // half a step, and the scale's rounding to a half
            q[i] = (float)(i % 7) - 3.0f;
            dot += (double)q[i] * want[i];
        }
        CHECK(same);
        CHECK_NEAR(kv_key_dot(l, j, q, HD), dot, 1e-3);
        q8_0_expected(v, HD, want);
        got = kv_value_f32(l, j, HD, tmp);
        for (int i = 0; i < HD; i++) same &= got[i] == want[i];
        CHECK(same);
    }
    // an infinite value spoils only its own block, without undefined behaviour
    for (int i = 0; i < HD; i++) k[i] = 1.0f;
    k[40] = INFINITY;
    kv_list_set_kv(l, 3, k, k, HD);
    const float *got = kv_key_f32(l, 3, HD, tmp);
    CHECK(got[0] == fp16_to_fp32(fp32_to_fp16(1.0f / 127.0f)) * 127.0f && !isfinite(got[40]) && !isfinite(got[33]));
    kv_cache_free(&c);
}

// Keys and values of different formats (llama.cpp's -ctk q8_0 -ctv f16, and the reverse):
// each reads back in its own, the bytes are the two rows' sizes, and a drop and a compaction
// move each array by its own row size.
static void check_mixed(int fmt_k, int fmt_v) {
    enum { HD = 64, N = 24 };
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 1, HD, 100, fmt_k, fmt_v) == PYKV_OK);
    const size_t row_k = kv_format_row_bytes(fmt_k, HD), row_v = kv_format_row_bytes(fmt_v, HD);
    CHECK(kv_cache_key_bytes(&c) == row_k && kv_cache_value_bytes(&c) == row_v);
    struct kv_list *l = kv_cache_list(&c, 0, 0);
    CHECK(kv_list_reserve(&c, l, N) == PYKV_OK);
    CHECK(c.bytes == (int64_t)l->cap * (int64_t)(row_k + row_v + 4));
    float k[N][HD], v[N][HD], want[HD], tmp[HD];
    for (int j = 0; j < N; j++) {
        for (int i = 0; i < HD; i++) {
            k[j][i] = ((float)rand() / (float)RAND_MAX - 0.5f) * 8.0f;
            v[j][i] = ((float)rand() / (float)RAND_MAX - 0.5f) * 0.5f;
        }
        kv_list_push(&c, l, k[j], v[j], j);
    }
    const int32_t keep[] = { 0, 3, 4, 5, 11, 17, 20, 21, 22, 23 };
    CHECK(kv_list_retain(&c, l, keep, 10) == PYKV_OK);
    CHECK(kv_list_drop(&c, l, 2, 3) == PYKV_OK);   // entry 4 goes; 20, the one before the tail, takes its slot
    const int32_t order[] = { 0, 3, 20, 5, 11, 17, 21, 22, 23 };
    CHECK(l->n == 9);
    for (int j = 0; j < l->n; j++) {
        const float *x[2] = { k[order[j]], v[order[j]] };
        for (int side = 0; side < 2; side++) {
            const int fmt = side ? fmt_v : fmt_k;
            if (fmt == KV_Q8_0) q8_0_expected(x[side], HD, want);
            else for (int i = 0; i < HD; i++) want[i] = fmt == KV_F16 ? fp16_to_fp32(fp32_to_fp16(x[side][i])) : x[side][i];
            const float *got = side ? kv_value_f32(l, j, HD, tmp) : kv_key_f32(l, j, HD, tmp);
            int same = l->pos[j] == order[j];
            for (int i = 0; i < HD; i++) same &= got[i] == want[i];
            CHECK(same);
        }
    }
    kv_cache_free(&c);
}

// kv_compact_rows against a plain gather: every subset shape a policy produces (one row
// dropped anywhere, a few dropped, scattered picks, runs of every length, nothing dropped),
// rows of an odd size.
static void check_compact_rows(void) {
    enum { N = 97, ROW = 3 };
    uint64_t rng = 12345;
    for (int trial = 0; trial < 400; trial++) {
        int32_t rows[N * ROW], want[N * ROW], keep[N], n_keep = 0;
        for (int i = 0; i < N * ROW; i++) rows[i] = i;
        const int n = 1 + trial % N, mode = trial % 4;
        const int drop = (int)(rng % (uint64_t)n);
        for (int32_t j = 0; j < n; j++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            const int r = (int)(rng >> 33) % 100;
            const int kept = mode == 0 ? j != drop : mode == 1 ? r >= 5 : mode == 2 ? r >= 60 : r >= 1;
            if (kept) keep[n_keep++] = j;
        }
        for (int32_t j = 0; j < n_keep; j++)
            for (int c = 0; c < ROW; c++) want[j * ROW + c] = rows[keep[j] * ROW + c];
        kv_compact_rows(rows, ROW * sizeof(int32_t), keep, n_keep);
        int same = 1;
        for (int32_t i = 0; i < n_keep * ROW; i++) same &= rows[i] == want[i];
        CHECK(same);
    }
}

// The GPU rows of an offloaded list (kv_device_rows): whole steps of 256, growing by half
// again, reserved ahead for a prefill that keeps every entry, given back when a compaction
// leaves half or less. The rule is host arithmetic, so it is checked here without a GPU.
static void check_device_rows(void) {
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 1, 64, 100000, KV_F16, KV_F16) == PYKV_OK);
    const int32_t S = KV_DEVICE_ROOM_STEP;
    CHECK(kv_device_rows(&c, 0, 500, 512) == 0);
    CHECK(kv_device_rows(&c, 16, 0, 0) == S);               // the first room: one step
    CHECK(kv_device_rows(&c, 18, 16, S) == S);               // grows within its rows
    CHECK(kv_device_rows(&c, S + 32, S, S) == 2 * S);        // past them: half as much again (384), rounded
    CHECK(kv_device_rows(&c, S + 68, S + 32, 2 * S) == 2 * S);
    // a list growing by an eighth from 16 to 8192 entries, as kv_list_reserve grows it, moves
    // on the GPU a dozen times, not the fifty times its room changes
    int32_t cap = 16, rows = kv_device_rows(&c, cap, 0, 0), moves = 0, steps = 0;
    while (cap < 8192) {
        const int32_t next = cap + cap / 8 > cap + 1 ? cap + cap / 8 : cap + 1, r = kv_device_rows(&c, next, cap, rows);
        CHECK(r >= next && r % S == 0);
        moves += r != rows;
        steps++;
        rows = r;
        cap = next;
    }
    CHECK(steps > 40 && moves <= 12);
    // a prefill that keeps every entry: its first chunk reserves rows for the rest, and the
    // later chunks grow into them (512 of 2048 is under half the rows: not a shrink)
    c.device_ahead = 1536;
    CHECK(kv_device_rows(&c, 512, 0, 0) == 2048);
    c.device_ahead = 1024;
    CHECK(kv_device_rows(&c, 1024, 512, 2048) == 2048);
    c.device_ahead = 0;
    // a compaction: to more than half the rows keeps them, to half or less gives the rest back
    CHECK(kv_device_rows(&c, 1500, 2048, 2048) == 2048);
    CHECK(kv_device_rows(&c, 1024, 2048, 2048) == 1024);
    CHECK(kv_device_rows(&c, 40, 2048, 2048) == S);
    // never past the cache's bound, nor under the room
    c.max_entries = 1000;
    CHECK(kv_device_rows(&c, 900, 800, 768) == 1000);
    kv_cache_free(&c);
}

int main(void) {
    check_device_rows();
    check_compact_rows();
    check_q8_0();
    check_mixed(KV_Q8_0, KV_F16);
    check_mixed(KV_F16, KV_Q8_0);
    check_mixed(KV_F32, KV_Q8_0);
    check_mixed(KV_F16, KV_F32);
    check_type(0);
    check_type(1);
    check_keep_prefix(0);
    check_keep_prefix(1);
    return check_report("test_kv_cache");
}
