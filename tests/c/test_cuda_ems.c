// ctest-label: cuda
// test_cuda_ems.c - the device work of EMS's decode steps on a GPU against the CPU, one line
// per case:
//  * cuda_ems_redundancy vs ems_redundancy_all: keys and values f32, f16, q8_0 (and mixed),
//    head_dim 64 and 128, many lists in one launch (1 to 3000 centres, the probe anywhere
//    among them), with a zero row and rows opposite the probe; max |difference| <= 2e-6 and
//    the same sign wherever the CPU's R is away from 0;
//  * cuda_copy_bytes vs memcpy: jobs of 1 to 4000 bytes at every alignment; equal bytes;
//  * kv_batch (kv-device-batch.c) vs the host: rows written, then moved as kv_drop_row moves
//    them (tails 0 to 40, drops anywhere), then rows brought back; equal bytes, with the
//    buffer reallocated between queuing and the run.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-cache.h"
#include "kv/kv-device-batch.h"
#include "kv/policies/ems/ems.h"

#define CUDA_CHECK_SEED 0x3C6EF372FE94F82Bull
#include "cuda-check.h"

// ---- redundancy ----

struct red_list {
    struct kv_cache  c;   // one list per case: its own cache (formats per case)
    struct ems_list  s;
    void            *dk, *dv;
};

static void random_list(struct red_list *rl, int fmt_k, int fmt_v, int d, int32_t n, int32_t weak) {
    CHECK(kv_cache_init(&rl->c, 1, 1, d, n + 1, fmt_k, fmt_v) == PYKV_OK);
    struct kv_list *l = kv_cache_list(&rl->c, 0, 0);
    CHECK(kv_list_reserve(&rl->c, l, n) == PYKV_OK);
    float k[PYKV_MAX_HEAD_DIM], v[PYKV_MAX_HEAD_DIM], pk[PYKV_MAX_HEAD_DIM], pv[PYKV_MAX_HEAD_DIM];
    for (int i = 0; i < d; i++) { pk[i] = uniform(-1.0f, 1.0f); pv[i] = uniform(-1.0f, 1.0f); }
    for (int32_t j = 0; j < n; j++) {
        const int kind = j == weak ? 0 : next_int(8);
        for (int i = 0; i < d; i++) {
            // 0: random; 1: near the probe; 2: opposite it; 3: a zero key; else random
            const float a = uniform(-1.0f, 1.0f), b = uniform(-1.0f, 1.0f);
            k[i] = kind == 1 ? pk[i] + 0.1f * a : kind == 2 ? -pk[i] + 0.1f * a : kind == 3 ? 0.0f : a;
            v[i] = kind == 1 ? pv[i] + 0.1f * b : kind == 2 ? pv[i] : b;
        }
        if (j == weak) { memcpy(k, pk, sizeof(k)); memcpy(v, pv, sizeof(v)); }
        kv_list_push(&rl->c, l, k, v, j);
    }
    rl->dk = dev_upload(l->k, kv_format_row_bytes(fmt_k, d) * (size_t)n);
    rl->dv = dev_upload(l->v, kv_format_row_bytes(fmt_v, d) * (size_t)n);
    memset(&rl->s, 0, sizeof(rl->s));
    CHECK(ems_list_track(&rl->s, n) == PYKV_OK);
}

static void test_redundancy(int fmt_k, int fmt_v, int d, int n_lists, int32_t n_max) {
    struct red_list *rl = calloc((size_t)n_lists, sizeof(*rl));
    struct cuda_ems_probe *jobs = calloc((size_t)n_lists, sizeof(*jobs));
    int64_t total = 0;
    int32_t max_nc = 0;
    for (int i = 0; i < n_lists; i++) {
        const int32_t n = i == 0 ? n_max : 2 + next_int(n_max - 1), nc = n - next_int(n < 40 ? n - 1 : 40);
        const int32_t weak = next_int(nc);
        random_list(&rl[i], fmt_k, fmt_v, d, n, weak);
        jobs[i] = (struct cuda_ems_probe){ .k = rl[i].dk, .v = rl[i].dv, .weak = weak, .nc = nc, .out = total };
        total += nc;
        max_nc = nc > max_nc ? nc : max_nc;
    }
    float *want = malloc((size_t)total * sizeof(float)), *got = malloc((size_t)total * sizeof(float));
    float *tmp = malloc((size_t)max_nc * sizeof(float));
    for (int i = 0; i < n_lists; i++) {
        const struct kv_list *l = kv_cache_list(&rl[i].c, 0, 0);
        struct ems_probe probe;
        ems_probe_init(&probe, l, d, jobs[i].weak);
        ems_redundancy_all(l, &rl[i].s, d, &probe, jobs[i].nc, want + jobs[i].out, tmp);
    }
    struct cuda_ems_probe *d_jobs = dev_upload(jobs, (size_t)n_lists * sizeof(*jobs));
    float *d_r = dev_alloc((size_t)total * sizeof(float));
    cuda_ems_redundancy(NULL, d_jobs, n_lists, max_nc, fmt_k, fmt_v, d, d_r);
    double worst = 0.0;
    int64_t sign_flips = 0;
    if (fetch(got, d_r, (size_t)total * sizeof(float), "cuda_ems_redundancy"))
        for (int64_t j = 0; j < total; j++) {
            const double e = fabs((double)got[j] - want[j]);
            worst = e > worst || isnan(e) ? e : worst;
            sign_flips += fabsf(want[j]) > 1e-4f && (got[j] < 0.0f) != (want[j] < 0.0f);
        }
    printf("ems redundancy k=%s v=%s d=%d lists=%d centres=%lld: max |diff| %.2e, sign flips %lld\n",
           kv_format_name(fmt_k), kv_format_name(fmt_v), d, n_lists, (long long)total, worst, (long long)sign_flips);
    CHECK(worst <= 2e-6);
    CHECK(sign_flips == 0);
    for (int i = 0; i < n_lists; i++) {
        cuda_free(rl[i].dk);
        cuda_free(rl[i].dv);
        ems_list_free(&rl[i].s);
        kv_cache_free(&rl[i].c);
    }
    cuda_free(d_jobs);
    cuda_free(d_r);
    free(rl); free(jobs); free(want); free(got); free(tmp);
}

// ---- byte copies ----

static void test_copy_bytes(int n_jobs) {
    const size_t span = 8192;
    unsigned char *src = malloc(span), *want = malloc(span * 2), *got = malloc(span * 2);
    for (size_t i = 0; i < span; i++) src[i] = (unsigned char)next_u32();
    for (size_t i = 0; i < 2 * span; i++) want[i] = 0xA5;
    unsigned char *d_src = dev_upload(src, span), *d_dst = dev_upload(want, 2 * span);
    struct cuda_byte_copy *jobs = calloc((size_t)n_jobs, sizeof(*jobs));
    size_t at = 0;   // destinations one after another, each at a random misalignment
    int made = 0;
    for (int i = 0; i < n_jobs; i++) {
        const size_t bytes = 1 + (size_t)next_int(i % 4 == 0 ? 4000 : 300), s_off = (size_t)next_int((int)(span - bytes));
        at += (size_t)next_int(17);
        if (at + bytes > 2 * span) break;
        jobs[made++] = (struct cuda_byte_copy){ .dst = d_dst + at, .src = d_src + s_off, .bytes = (int64_t)bytes };
        memcpy(want + at, src + s_off, bytes);
        at += bytes;
    }
    struct cuda_byte_copy *d_jobs = dev_upload(jobs, (size_t)(made ? made : 1) * sizeof(*jobs));
    cuda_copy_bytes(NULL, d_jobs, made);
    const int same = fetch(got, d_dst, 2 * span, "cuda_copy_bytes") && memcmp(got, want, 2 * span) == 0;
    printf("copy bytes: %d jobs, %zu bytes: %s\n", made, at, same ? "equal" : "DIFFER");
    CHECK(same);
    cuda_free(d_src); cuda_free(d_dst); cuda_free(d_jobs);
    free(src); free(want); free(got); free(jobs);
}

// ---- the batch ----

// n rows of row_bytes on the device: row w written, then row j dropped as kv_drop_row drops it
// (tail rows stay last), then rows r0..r0+3 brought back; with `grow`, the buffer moves to a
// larger one between queuing and the run.
static void test_batch(size_t row_bytes, int32_t n, int32_t w, int32_t j, int32_t tail, int grow) {
    unsigned char *rows = malloc((size_t)n * row_bytes), *row = malloc(row_bytes), *got = malloc((size_t)n * row_bytes);
    for (size_t i = 0; i < (size_t)n * row_bytes; i++) rows[i] = (unsigned char)next_u32();
    for (size_t i = 0; i < row_bytes; i++) row[i] = (unsigned char)next_u32();
    void *d = dev_upload(rows, (size_t)n * row_bytes);
    struct kv_batch b;
    kv_batch_init(&b, 0, NULL);
    // the host: the write, then the drop
    memcpy(rows + (size_t)w * row_bytes, row, row_bytes);
    kv_drop_row(rows, row_bytes, n, j, tail);
    void *up = kv_batch_upload(&b, &d, (int64_t)w * (int64_t)row_bytes, row_bytes);
    CHECK(up != NULL);
    if (up) memcpy(up, row, row_bytes);
    const int32_t h = n - tail > j + 1 ? n - tail : j + 1;   // kv_drop_row's split
    CHECK(kv_batch_move(&b, &d, row_bytes, j, h - 1, h - 1 > j) == PYKV_OK);
    CHECK(kv_batch_move(&b, &d, row_bytes, h - 1, h, n - h) == PYKV_OK);
    const int32_t r0 = next_int(n > 4 ? n - 4 : 1), nr = n - 1 < 4 ? n - 1 : 4;
    const int64_t at = kv_batch_download(&b, &d, (int64_t)r0 * (int64_t)row_bytes, (size_t)nr * row_bytes);
    CHECK(at >= 0);
    if (grow) {   // the batch reads the buffer's pointer when it runs
        void *bigger = dev_alloc((size_t)(2 * n) * row_bytes);
        CHECK(cuda_copy_d2d(bigger, d, (size_t)n * row_bytes, NULL) == PYKV_OK);
        CHECK(cuda_stream_sync(NULL) == PYKV_OK);
        cuda_free(d);
        d = bigger;
    }
    CHECK(kv_batch_run(&b) == PYKV_OK);
    const int same = fetch(got, d, (size_t)(n - 1) * row_bytes, "kv_batch") &&
                     memcmp(got, rows, (size_t)(n - 1) * row_bytes) == 0;
    const int back = at >= 0 && memcmp(kv_batch_downloaded(&b, at), rows + (size_t)r0 * row_bytes, (size_t)nr * row_bytes) == 0;
    printf("batch: %d rows of %zu bytes, write %d, drop %d tail %d%s: %s, rows back %s\n", n, row_bytes, w, j, tail,
           grow ? ", buffer moved" : "", same ? "equal" : "DIFFER", back ? "equal" : "DIFFER");
    CHECK(same);
    CHECK(back);
    kv_batch_free(&b);
    cuda_free(d);
    free(rows); free(row); free(got);
}

int main(void) {
    if (!cuda_test_start("test_cuda_ems")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);

    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++) {
        test_redundancy(fmt, fmt, 64, 5, 700);
        test_redundancy(fmt, fmt, 128, 40, 300);
    }
    test_redundancy(KV_F16, KV_Q8_0, 128, 3, 3000);
    test_redundancy(KV_F32, KV_F16, 64, 1, 2);

    for (int i = 0; i < 4; i++) test_copy_bytes(1 + i * 20);

    const size_t row_bytes[] = { 256, 136, 512, 34, 6 };
    for (int a = 0; a < 5; a++)
        for (int32_t tail = 0; tail <= 40; tail += 20) {
            const int32_t n = 100 + next_int(60);
            test_batch(row_bytes[a], n, next_int(n), next_int(n), tail, 0);
            test_batch(row_bytes[a], n, n - 1, next_int(n - tail), tail, a % 2);
        }
    test_batch(256, 2, 0, 0, 1, 1);
    return check_report("test_cuda_ems");
}
