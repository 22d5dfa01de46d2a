// kv-device-batch.c - copies to and from device buffers sent together (kv-device-batch.h).
#include "kv/kv-device-batch.h"
#include "core/error.h"

#include <stdlib.h>
#include <string.h>

void kv_batch_init(struct kv_batch *b, int device, void *stream) {
    memset(b, 0, sizeof(*b));
    b->device = device;
    b->stream = stream;
}

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-device.h"

#define BATCH_ALIGN 16   // staged pieces start here, so that the copy kernel moves 16 bytes at a time

static size_t aligned(size_t x) { return (x + BATCH_ALIGN - 1) / BATCH_ALIGN * BATCH_ALIGN; }

// One more copy, in the room kv_batch_reserve made for it.
static void push(struct kv_batch *b, struct kv_batch_copy c) { b->copies[b->n_copies++] = c; }

// Bytes of h_up / d_up for `up` staged bytes and `copies` copies.
static size_t up_bytes(size_t up, int64_t copies) {
    return aligned(up) + (size_t)copies * sizeof(struct cuda_byte_copy);
}

void kv_batch_free(struct kv_batch *b) {
    if (!b->copies && !b->h_up && !b->h_down && !b->d_up && !b->d_scratch && !b->d_down) return;
    cuda_set_device(b->device);
    cuda_host_free(b->h_up);
    cuda_host_free(b->h_down);
    cuda_free_async(b->d_up, (cuda_stream)b->stream);
    cuda_free_async(b->d_scratch, (cuda_stream)b->stream);
    cuda_free_async(b->d_down, (cuda_stream)b->stream);
    free(b->copies);
    memset(b, 0, sizeof(*b));
}

// A device buffer of at least `need` bytes (contents not kept: the batch fills it each run).
static pykv_status device_room(struct kv_batch *b, void **d, size_t *cap, size_t need) {
    if (need <= *cap) return PYKV_OK;
    const size_t bytes = need > 2 * *cap ? need : 2 * *cap;
    void *x = NULL;
    PYKV_TRY(cuda_alloc_async(&x, bytes, (cuda_stream)b->stream, "a batch of KV cache copies"));
    cuda_free_async(*d, (cuda_stream)b->stream);
    *d = x;
    *cap = bytes;
    return PYKV_OK;
}

pykv_status kv_batch_reserve(struct kv_batch *b, size_t up, int32_t copies, size_t scratch, size_t down) {
    PYKV_TRY(cuda_set_device(b->device));
    const int64_t n = (int64_t)b->n_copies + copies;
    if (n > b->copies_cap) {   // grown by doubling: queuing reserves one copy at a time
        const int64_t cap = n > 2 * (int64_t)b->copies_cap ? n : 2 * (int64_t)b->copies_cap;
        struct kv_batch_copy *x = realloc(b->copies, (size_t)cap * sizeof(*x));
        if (!x) return pykv_error(PYKV_ERR_NOMEM, "out of memory queuing KV cache copies");
        b->copies = x;
        b->copies_cap = (int32_t)cap;
    }
    const size_t need_up = up_bytes(b->up_used + aligned(up), n);
    if (need_up > b->up_cap) {   // pinned: the staged bytes move with it; device: filled at the run
        const size_t bytes = need_up > 2 * b->up_cap ? need_up : 2 * b->up_cap;
        char *h = NULL;
        PYKV_TRY(cuda_host_alloc((void **)&h, bytes));
        size_t d_cap = b->up_cap;
        const pykv_status st = device_room(b, &b->d_up, &d_cap, bytes);
        if (st != PYKV_OK) {
            cuda_host_free(h);
            return st;
        }
        if (b->up_used) memcpy(h, b->h_up, b->up_used);
        cuda_host_free(b->h_up);
        b->h_up = h;
        b->up_cap = bytes;
    }
    PYKV_TRY(device_room(b, &b->d_scratch, &b->scratch_cap, b->scratch_used + aligned(scratch)));
    const size_t need_down = b->down_used + aligned(down);
    if (need_down > b->down_cap) {
        size_t cap = b->down_cap;
        PYKV_TRY(device_room(b, &b->d_down, &cap, need_down));
        char *h = NULL;
        PYKV_TRY(cuda_host_alloc((void **)&h, cap));
        cuda_host_free(b->h_down);
        b->h_down = h;
        b->down_cap = cap;
    }
    return PYKV_OK;
}

void *kv_batch_upload(struct kv_batch *b, void *const *dst_ref, int64_t dst_off, size_t bytes) {
    if (kv_batch_reserve(b, bytes, 1, 0, 0) != PYKV_OK) return NULL;
    const size_t at = b->up_used;
    b->up_used += aligned(bytes);
    push(b, (struct kv_batch_copy){ .dst_ref = dst_ref, .dst_off = dst_off, .src_ref = &b->d_up,
                                    .src_off = (int64_t)at, .bytes = (int64_t)bytes, .stage = KV_BATCH_WRITE });
    return b->h_up + at;
}

pykv_status kv_batch_move(struct kv_batch *b, void *const *ref, size_t row_bytes, int32_t dst, int32_t src,
                          int32_t len) {
    if (len <= 0 || dst == src) return PYKV_OK;
    const size_t bytes = (size_t)len * row_bytes;
    PYKV_TRY(kv_batch_reserve(b, 0, 2, bytes, 0));
    const int64_t at = (int64_t)b->scratch_used;
    b->scratch_used += aligned(bytes);
    push(b, (struct kv_batch_copy){ .dst_ref = &b->d_scratch, .dst_off = at, .src_ref = ref,
                                    .src_off = (int64_t)src * (int64_t)row_bytes, .bytes = (int64_t)bytes,
                                    .stage = KV_BATCH_GATHER });
    push(b, (struct kv_batch_copy){ .dst_ref = ref, .dst_off = (int64_t)dst * (int64_t)row_bytes,
                                    .src_ref = &b->d_scratch, .src_off = at, .bytes = (int64_t)bytes,
                                    .stage = KV_BATCH_SCATTER });
    return PYKV_OK;
}

int64_t kv_batch_download(struct kv_batch *b, void *const *src_ref, int64_t src_off, size_t bytes) {
    if (kv_batch_reserve(b, 0, 1, 0, bytes) != PYKV_OK) return -1;
    const int64_t at = (int64_t)b->down_used;
    b->down_used += aligned(bytes);
    push(b, (struct kv_batch_copy){ .dst_ref = &b->d_down, .dst_off = at, .src_ref = src_ref, .src_off = src_off,
                                    .bytes = (int64_t)bytes, .stage = KV_BATCH_READ });
    return at;
}

pykv_status kv_batch_run(struct kv_batch *b) {
    if (b->n_copies == 0) return PYKV_OK;
    const cuda_stream s = (cuda_stream)b->stream;
    PYKV_TRY(cuda_set_device(b->device));
    PYKV_TRY(kv_device_flush_moves(b->stream));   // rows moved before the batch reads them
    // the copy list after the staged bytes, stage by stage, with the buffers' addresses as they are now
    struct cuda_byte_copy *list = (struct cuda_byte_copy *)(b->h_up + aligned(b->up_used));
    int32_t count[KV_BATCH_STAGES] = { 0 }, first[KV_BATCH_STAGES], at[KV_BATCH_STAGES];
    for (int32_t i = 0; i < b->n_copies; i++) count[b->copies[i].stage]++;
    for (int st = 0, sum = 0; st < KV_BATCH_STAGES; sum += count[st], st++) first[st] = at[st] = sum;
    for (int32_t i = 0; i < b->n_copies; i++) {
        const struct kv_batch_copy *c = &b->copies[i];
        list[at[c->stage]++] = (struct cuda_byte_copy){ .dst = (char *)*c->dst_ref + c->dst_off,
                                                        .src = (const char *)*c->src_ref + c->src_off,
                                                        .bytes = c->bytes };
    }
    const size_t down = b->down_used;
    pykv_status st = cuda_upload_async(b->d_up, b->h_up, up_bytes(b->up_used, b->n_copies), s);
    const struct cuda_byte_copy *d_list = (const struct cuda_byte_copy *)((char *)b->d_up + aligned(b->up_used));
    for (int k = 0; st == PYKV_OK && k < KV_BATCH_STAGES; k++) cuda_copy_bytes(s, d_list + first[k], count[k]);
    if (st == PYKV_OK) st = cuda_check("copying KV cache rows on the GPU");
    if (st == PYKV_OK && down) st = cuda_download_async(b->h_down, b->d_down, down, s);
    b->n_copies = 0;
    b->up_used = b->scratch_used = b->down_used = 0;
    const pykv_status done = cuda_stream_sync(s);
    return st != PYKV_OK ? st : done;
}

#else   // no device lists without CUDA

void kv_batch_free(struct kv_batch *b) {
    free(b->copies);
    memset(b, 0, sizeof(*b));
}
static pykv_status no_cuda(void) { return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend"); }
pykv_status kv_batch_reserve(struct kv_batch *b, size_t up, int32_t copies, size_t scratch, size_t down) {
    (void)b; (void)up; (void)copies; (void)scratch; (void)down;
    return no_cuda();
}
void *kv_batch_upload(struct kv_batch *b, void *const *dst_ref, int64_t dst_off, size_t bytes) {
    (void)b; (void)dst_ref; (void)dst_off; (void)bytes;
    return NULL;
}
pykv_status kv_batch_move(struct kv_batch *b, void *const *ref, size_t row_bytes, int32_t dst, int32_t src,
                          int32_t len) {
    (void)b; (void)ref; (void)row_bytes; (void)dst; (void)src; (void)len;
    return no_cuda();
}
int64_t kv_batch_download(struct kv_batch *b, void *const *src_ref, int64_t src_off, size_t bytes) {
    (void)b; (void)src_ref; (void)src_off; (void)bytes;
    return -1;
}
pykv_status kv_batch_run(struct kv_batch *b) { return b->n_copies ? no_cuda() : PYKV_OK; }

#endif
