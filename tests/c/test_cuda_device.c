// ctest-label: cuda
// The device layer (ggml-cuda/device.h): copies that round-trip, staged uploads (the source
// rewritten as soon as each returns, the pinned ring wrapped several times, on a stream that
// is busy), an allocation larger than the card that fails with a message naming the sizes
// instead of aborting, and memory given back.
#include "cuda-check.h"
#include "pykv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
    if (!cuda_test_start("test_cuda_device")) return CHECK_SKIP;
    char name[256];
    CHECK(cuda_device_describe(0, name, sizeof(name)) == PYKV_OK);
    CHECK(strstr(name, "GiB free of") != NULL);
    CHECK(cuda_device_describe(cuda_device_count(), name, sizeof(name)) == PYKV_ERR_INVALID_ARG);

    enum { N = 1 << 20 };
    unsigned char *a = malloc(N), *b = malloc(N);
    for (int i = 0; i < N; i++) a[i] = (unsigned char)(i * 131 + 7);
    void *d = NULL, *d2 = NULL;
    CHECK(cuda_alloc(&d, N, "a test buffer") == PYKV_OK && d);
    CHECK(cuda_alloc(&d2, N, "a test buffer") == PYKV_OK && d2);
    CHECK(cuda_upload(d, a, N) == PYKV_OK);
    CHECK(cuda_copy_d2d(d2, d, N, NULL) == PYKV_OK);
    CHECK(cuda_download(b, d2, N) == PYKV_OK);
    CHECK(memcmp(a, b, N) == 0);
    CHECK(cuda_memset(d2, 0, N, NULL) == PYKV_OK && cuda_stream_sync(NULL) == PYKV_OK);
    CHECK(cuda_download(b, d2, N) == PYKV_OK && b[0] == 0 && b[N - 1] == 0);
    cuda_free(d);
    cuda_free(d2);

    {   // staged uploads: 24 MiB in pieces of 1 byte to 20 KiB, and a few too large to stage
        enum { OUT = 24 << 20 };
        unsigned char *want = malloc(OUT), *got = malloc(OUT), *src = malloc(2 << 20);
        void *dst = NULL, *busy = NULL;
        cuda_stream s = NULL;
        CHECK(cuda_stream_create(&s) == PYKV_OK);
        CHECK(cuda_alloc(&dst, OUT, "a test buffer") == PYKV_OK && dst);
        CHECK(cuda_alloc(&busy, N, "a test buffer") == PYKV_OK && busy);
        unsigned x = 12345;
        size_t at = 0;
        int pieces = 0;
        while (dst && busy && at < OUT) {
            size_t bytes = 1 + (x = x * 1103515245u + 12345u) % (20 << 10);
            if (pieces % 500 == 499) bytes = (size_t)(3 << 19) + 7;   // past a quarter of the ring
            if (at + bytes > OUT) bytes = OUT - at;
            for (size_t i = 0; i < bytes; i++) src[i] = (unsigned char)(x >> 8) + (unsigned char)i;
            memcpy(want + at, src, bytes);
            if (pieces % 64 == 0) CHECK(cuda_memset(busy, pieces & 0xFF, N, s) == PYKV_OK);   // the stream has work queued
            CHECK(cuda_upload_staged((char *)dst + at, src, bytes, s) == PYKV_OK);
            memset(src, 0xEE, bytes);   // the caller's buffer is its own again at once
            at += bytes;
            pieces++;
        }
        CHECK(cuda_stream_sync(s) == PYKV_OK);
        const int same = dst && cuda_download(got, dst, OUT) == PYKV_OK && memcmp(got, want, OUT) == 0;
        printf("staged uploads: %d pieces, %zu bytes: %s\n", pieces, at, same ? "equal" : "DIFFER");
        CHECK(same);
        cuda_free(dst);
        cuda_free(busy);
        cuda_stream_destroy(s);
        free(want); free(got); free(src);
    }

    size_t free0 = 0, total = 0;
    CHECK(cuda_mem_info(&free0, &total) == PYKV_OK && free0 > 0 && total >= free0);
    void *huge = (void *)1;
    const pykv_status st = cuda_alloc(&huge, total * 4, "a test of the out-of-memory path");
    CHECK(st == PYKV_ERR_NOMEM && huge == NULL);
    printf("out of memory: %s\n", pykv_last_error());
    CHECK(strstr(pykv_last_error(), "out of GPU memory for a test of the out-of-memory path") != NULL);
    CHECK(strstr(pykv_last_error(), "MiB needed") != NULL);
    CHECK(cuda_check("after the failed allocation") == PYKV_OK);   // nothing sticky is left

    // a thousand allocations and frees leave the free memory where it was
    for (int i = 0; i < 1000; i++) {
        void *p = NULL;
        if (cuda_alloc(&p, (size_t)(i % 7 + 1) << 20, "a test buffer") != PYKV_OK) break;
        cuda_free(p);
    }
    size_t free1 = 0;
    CHECK(cuda_mem_info(&free1, &total) == PYKV_OK);
    CHECK(free1 + (8u << 20) >= free0);

    cuda_stream s = NULL;
    CHECK(cuda_stream_create(&s) == PYKV_OK);
    CHECK(cuda_stream_sync(s) == PYKV_OK);
    cuda_stream_destroy(s);
    free(a);
    free(b);
    return check_report("test_cuda_device");
}
