// ctest-label: cuda
// test_cuda_retain.c - a device list's compaction with the kept indices in device memory
// (kv_list_retain_device_indices, which TAKE's queued eviction uses) against kv_list_retain
// on a host twin (twin-lists.h), one line per case: f32, f16 and q8_0 rows, head_dim 64 and
// 128, lists of 20 to 3000 entries keeping 1, a few, half and all but 3 of them (ascending
// random subsets); the kept rows byte for byte, the positions once written from the indices,
// and the cache's counts (entries, bytes, device bytes less the host twin's, evictions).
// kv_list_retain_gathers says which drops compact: not a decode step's one or two entries.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv-cache.h"

#define CUDA_CHECK_SEED 0x3C6EF372FE94F82Bull
#include "cuda-check.h"
#include "twin-lists.h"

static void test_retain(int fmt, int d, int32_t n, int32_t n_keep) {
    struct kv_cache host, dev;
    CHECK(kv_cache_init(&host, 1, 1, d, n, fmt, fmt) == PYKV_OK);
    CHECK(kv_cache_init(&dev, 1, 1, d, n, fmt, fmt) == PYKV_OK);
    kv_cache_set_device(&dev, 0, 0, NULL);
    float *k = malloc((size_t)n * d * sizeof(float)), *v = malloc((size_t)n * d * sizeof(float));
    fill(k, (size_t)n * d, -2.0f, 2.0f);
    fill(v, (size_t)n * d, -2.0f, 2.0f);
    twin_list_fill(&host, &dev, 0, n, k, v);
    struct kv_list *h = kv_cache_list(&host, 0, 0), *l = kv_cache_list(&dev, 0, 0);
    int32_t *keep = malloc((size_t)n * sizeof(int32_t)), *old_pos = malloc((size_t)n * sizeof(int32_t));
    for (int32_t i = 0, j = 0; i < n_keep; j++)   // an ascending random subset
        if (next_int(n - j) < n_keep - i) keep[i++] = j;
    memcpy(old_pos, l->pos, (size_t)n * sizeof(int32_t));
    const int gathers = kv_list_retain_gathers(l, n_keep);
    int same = gathers;
    if (gathers) {
        int32_t *d_keep = dev_upload(keep, (size_t)n_keep * sizeof(int32_t));
        same = ok(kv_list_retain(&host, h, keep, n_keep), "kv_list_retain") &&
               ok(kv_list_retain_device_indices(&dev, l, d_keep, n_keep), "kv_list_retain_device_indices");
        for (int32_t j = 0; same && j < n_keep; j++) l->pos[j] = old_pos[keep[j]];   // the caller's part
        int64_t kept = 0;
        same = same && twin_list_same(&host, &dev, 0, &kept) && kept == n_keep;
        same = same && l->cap == h->cap && dev.bytes == host.bytes && dev.evicted == host.evicted;
        same = same && dev.device_bytes == (int64_t)l->cap * (int64_t)(kv_cache_key_bytes(&dev) + kv_cache_value_bytes(&dev));
        cuda_free(d_keep);
    }
    printf("retain on the device %s d=%d: %d of %d kept: %s\n", kv_format_name(fmt), d, n_keep, n,
           !gathers ? "does not compact" : same ? "equal" : "DIFFERENT");
    CHECK(same);
    free(k); free(v); free(keep); free(old_pos);
    kv_cache_free(&host);
    kv_cache_free(&dev);
}

int main(void) {
    if (!cuda_test_start("test_cuda_retain")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++)
        for (int d = 64; d <= 128; d += 64) {
            const int32_t lengths[] = { 20, 300, 3000 };
            for (int i = 0; i < 3; i++) {
                const int32_t n = lengths[i];
                const int32_t keeps[] = { 1, 5, n / 2, n - 3 };
                for (int j = 0; j < 4; j++) test_retain(fmt, d, n, keeps[j]);
            }
        }
    // a decode step's drop keeps the list's room: not for this path
    struct kv_cache dev;
    CHECK(kv_cache_init(&dev, 1, 1, 64, 400, KV_F16, KV_F16) == PYKV_OK);
    kv_cache_set_device(&dev, 0, 0, NULL);
    struct kv_list *l = kv_cache_list(&dev, 0, 0);
    CHECK(kv_list_reserve(&dev, l, 300) == PYKV_OK);
    l->n = 300;
    CHECK(!kv_list_retain_gathers(l, 299) && !kv_list_retain_gathers(l, 300) && kv_list_retain_gathers(l, 150));
    CHECK(kv_list_retain_device_indices(&dev, l, NULL, 299) == PYKV_ERR_INTERNAL && l->n == 300);
    kv_cache_free(&dev);
    return check_report("test_cuda_retain");
}
