// test_gguf.c - the GGUF reader on a file built byte by byte here: values, tensor placement,
// and every truncation and many random corruptions failing cleanly (run under ASan/UBSan).
#include "check.h"
#include "model/gguf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct buf {
    uint8_t data[4096];
    size_t  n;
};

static void put(struct buf *b, const void *p, size_t n) { memcpy(b->data + b->n, p, n); b->n += n; }
static void put_u32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(struct buf *b, const char *s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }

// A small but complete GGUF v3: six keys (scalars, string, string array, nested array),
// two tensors (f32 [4] and q8_0 [32, 2]), 32-byte alignment.
static size_t build_gguf(struct buf *b) {
    b->n = 0;
    put_u32(b, 0x46554747u);
    put_u32(b, 3);
    put_u64(b, 2);   // tensors
    put_u64(b, 6);   // kvs
    put_str(b, "general.architecture"); put_u32(b, GGUF_TYPE_STRING); put_str(b, "llama");
    put_str(b, "llama.block_count"); put_u32(b, GGUF_TYPE_UINT32); put_u32(b, 7);
    put_str(b, "llama.rope.freq_base"); put_u32(b, GGUF_TYPE_FLOAT32); { float f = 10000.0f; put(b, &f, 4); }
    put_str(b, "tokenizer.ggml.tokens"); put_u32(b, GGUF_TYPE_ARRAY); put_u32(b, GGUF_TYPE_STRING); put_u64(b, 3);
    put_str(b, "a"); put_str(b, "bc"); put_str(b, "");
    put_str(b, "nested"); put_u32(b, GGUF_TYPE_ARRAY); put_u32(b, GGUF_TYPE_ARRAY); put_u64(b, 2);
    for (int i = 0; i < 2; i++) { put_u32(b, GGUF_TYPE_INT32); put_u64(b, 2); put_u32(b, 1); put_u32(b, 2); }
    put_str(b, "scores"); put_u32(b, GGUF_TYPE_ARRAY); put_u32(b, GGUF_TYPE_INT16); put_u64(b, 2);
    { int16_t v[2] = { -5, 9 }; put(b, v, 4); }
    put_str(b, "vec"); put_u32(b, 1); put_u64(b, 4); put_u32(b, PYKV_TYPE_F32); put_u64(b, 0);
    put_str(b, "mat"); put_u32(b, 2); put_u64(b, 32); put_u64(b, 2); put_u32(b, PYKV_TYPE_Q8_0); put_u64(b, 32);
    while (b->n % 32) b->data[b->n++] = 0;
    size_t data_start = b->n;
    float vec[4] = { 1, 2, 3, 4 };
    put(b, vec, sizeof(vec));
    while ((b->n - data_start) % 32) b->data[b->n++] = 0;
    for (int i = 0; i < 68; i++) b->data[b->n++] = (uint8_t)i;   // two q8_0 blocks
    return data_start;
}

static void write_file(const char *path, const uint8_t *data, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(data, 1, n, f);
    fclose(f);
}

static void test_valid(const char *path) {
    struct buf b;
    size_t data_start = build_gguf(&b);
    write_file(path, b.data, b.n);
    for (int use_mmap = 0; use_mmap <= 1; use_mmap++) {
        struct gguf_file *f = NULL;
        CHECK(gguf_open(path, use_mmap, &f) == PYKV_OK);
        if (!f) return;
        CHECK(f->version == 3 && f->n_kv == 6 && f->n_tensors == 2 && f->alignment == 32);
        int64_t blocks = 0;
        CHECK(gguf_get_int(f, "llama.block_count", 1, &blocks) == PYKV_OK && blocks == 7);
        double base = 0;
        CHECK(gguf_get_float(f, "llama.rope.freq_base", 1, &base) == PYKV_OK && base == 10000.0);
        struct gguf_str arch = { 0 };
        CHECK(gguf_get_str(f, "general.architecture", 1, &arch) == PYKV_OK && gguf_str_eq(arch, "llama"));
        CHECK(gguf_get_str(f, "llama.block_count", 1, &arch) == PYKV_ERR_FORMAT);   // wrong type
        CHECK(gguf_get_int(f, "missing.key", 1, &blocks) == PYKV_ERR_FORMAT);
        CHECK(gguf_get_int(f, "missing.key", 0, &blocks) == PYKV_OK && blocks == 7);
        const struct gguf_kv *toks = NULL;
        CHECK(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, 1, &toks) == PYKV_OK);
        CHECK(toks && toks->arr_n == 3 && gguf_str_eq(toks->arr_strs[1], "bc") && toks->arr_strs[2].len == 0);
        const struct gguf_kv *scores = NULL;
        CHECK(gguf_get_arr(f, "scores", GGUF_TYPE_INT32, 1, &scores) == PYKV_OK);
        CHECK(scores && gguf_arr_int(scores, 0) == -5 && gguf_arr_int(scores, 1) == 9);
        const struct gguf_tensor *vec = gguf_find_tensor(f, "vec"), *mat = gguf_find_tensor(f, "mat");
        CHECK(vec && vec->offset == data_start && vec->n_bytes == 16 && ((const float *)vec->data)[3] == 4.0f);
        CHECK(mat && mat->offset == data_start + 32 && mat->n_bytes == 68 && mat->ne[0] == 32 && mat->ne[1] == 2);
        gguf_close(f);
    }
}

// Every strict prefix of the file must be rejected with an error, never read past the end.
static void test_truncations(const char *path) {
    struct buf b;
    build_gguf(&b);
    int rejected = 0;
    for (size_t n = 0; n < b.n; n++) {
        write_file(path, b.data, n);
        struct gguf_file *f = NULL;
        pykv_status st = gguf_open(path, n % 2, &f);
        if (st != PYKV_OK && f == NULL && pykv_last_error()[0] != '\0') rejected++;
        gguf_close(f);
    }
    CHECK(rejected == (int)b.n);
}

static void test_bad_headers(const char *path) {
    struct buf b;
    build_gguf(&b);
    struct gguf_file *f = NULL;

    b.data[0] = 'X';
    write_file(path, b.data, b.n);
    CHECK(gguf_open(path, 1, &f) == PYKV_ERR_FORMAT && strstr(pykv_last_error(), "magic"));

    build_gguf(&b);
    uint32_t v1 = 1;
    memcpy(b.data + 4, &v1, 4);
    write_file(path, b.data, b.n);
    CHECK(gguf_open(path, 1, &f) == PYKV_ERR_UNSUPPORTED && strstr(pykv_last_error(), "version"));

    build_gguf(&b);
    uint64_t huge = (uint64_t)1 << 60;
    memcpy(b.data + 16, &huge, 8);   // n_kv
    write_file(path, b.data, b.n);
    CHECK(gguf_open(path, 1, &f) == PYKV_ERR_FORMAT);

    CHECK(gguf_open("/nonexistent/model.gguf", 1, &f) == PYKV_ERR_IO && strstr(pykv_last_error(), "nonexistent"));
    CHECK(f == NULL);
}

// A tensor whose dimensions are each allowed but whose size does not fit in 64 bits: the
// product of [32, 2^32, 2^32] wraps to 0, which must not pass for an empty tensor.
static void test_overflowing_shape(const char *path) {
    const uint64_t shapes[][3] = { { 32, 1ull << 32, 1ull << 32 }, { 1ull << 40, 1ull << 30, 1 },
                                   { 32, 1ull << 40, 1ull << 30 } };
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        struct buf b = { .n = 0 };
        put_u32(&b, 0x46554747u);
        put_u32(&b, 3);
        put_u64(&b, 1);   // tensors
        put_u64(&b, 0);   // kvs
        put_str(&b, "big"); put_u32(&b, 3);
        for (int d = 0; d < 3; d++) put_u64(&b, shapes[s][d]);
        put_u32(&b, PYKV_TYPE_F32); put_u64(&b, 0);
        while (b.n % 32) b.data[b.n++] = 0;
        for (int i = 0; i < 128; i++) b.data[b.n++] = 0;
        write_file(path, b.data, b.n);
        struct gguf_file *f = NULL;
        CHECK(gguf_open(path, 1, &f) == PYKV_ERR_FORMAT && strstr(pykv_last_error(), "overflows"));
        CHECK(f == NULL);
        gguf_close(f);
    }
}

// Flip random bytes: the reader may accept or reject, but must never crash or over-read
// (ASan checks the latter).
static void test_random_corruption(const char *path) {
    struct buf b;
    srand(1234);
    int ok = 0, failed = 0;
    for (int iter = 0; iter < 3000; iter++) {
        build_gguf(&b);
        int flips = 1 + rand() % 4;
        for (int i = 0; i < flips; i++) b.data[rand() % b.n] = (uint8_t)rand();
        write_file(path, b.data, b.n);
        struct gguf_file *f = NULL;
        if (gguf_open(path, iter % 2, &f) == PYKV_OK) ok++; else failed++;
        gguf_close(f);
    }
    CHECK(ok + failed == 3000);
    CHECK(failed > 0);
}

int main(void) {
    char path[] = "/tmp/pykv-test-gguf-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return 1;
    close(fd);
    test_valid(path);
    test_truncations(path);
    test_bad_headers(path);
    test_overflowing_shape(path);
    test_random_corruption(path);
    unlink(path);
    return check_report("test_gguf");
}
