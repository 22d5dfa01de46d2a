// kv-device.c - device memory for offloaded KV lists (kv-device.h).
#include "kv/kv-device.h"
#include "core/error.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"

// Stream-ordered on the context's stream: the copy and the free come after the kernels queued
// there that read the old buffer, the kernels queued after them see the new one, and nothing
// waits on the host.
pykv_status kv_device_resize(int device, void *s, void **p, size_t old_bytes, size_t new_bytes) {
    const cuda_stream st = (cuda_stream)s;
    PYKV_TRY(cuda_set_device(device));   // the thread growing the list may not have chosen it
    if (new_bytes == 0) {
        cuda_free_async(*p, st);
        *p = NULL;
        return PYKV_OK;
    }
    void *q = NULL;
    PYKV_TRY(cuda_alloc_async(&q, new_bytes, st, "the KV cache"));
    const size_t keep = old_bytes < new_bytes ? old_bytes : new_bytes;
    if (*p && keep) {
        const pykv_status err = cuda_copy_d2d(q, *p, keep, st);
        if (err != PYKV_OK) {
            cuda_free_async(q, st);
            return err;
        }
    }
    cuda_free_async(*p, st);
    *p = q;
    return PYKV_OK;
}

pykv_status kv_device_read(void *s, void *dst, const void *d_src, size_t bytes) {
    PYKV_TRY(cuda_download_async(dst, d_src, bytes, (cuda_stream)s));
    return cuda_stream_sync((cuda_stream)s);
}
pykv_status kv_device_write(void *s, void *d_dst, const void *src, size_t bytes) {
    PYKV_TRY(cuda_upload_async(d_dst, src, bytes, (cuda_stream)s));
    return cuda_stream_sync((cuda_stream)s);
}

#else

static pykv_status no_cuda(void) {
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status kv_device_resize(int device, void *s, void **p, size_t old_bytes, size_t new_bytes) {
    (void)device; (void)s; (void)p; (void)old_bytes; (void)new_bytes;
    return no_cuda();
}
pykv_status kv_device_read(void *s, void *dst, const void *d_src, size_t bytes) {
    (void)s; (void)dst; (void)d_src; (void)bytes;
    return no_cuda();
}
pykv_status kv_device_write(void *s, void *d_dst, const void *src, size_t bytes) {
    (void)s; (void)d_dst; (void)src; (void)bytes;
    return no_cuda();
}

#endif
