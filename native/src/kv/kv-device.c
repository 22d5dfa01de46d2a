// kv-device.c - device memory for offloaded KV lists (kv-device.h).
#include "kv/kv-device.h"
#include "core/error.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"

// Stream-ordered on the legacy default stream: the contexts' streams are blocking ones, so the
// copy and the free wait for the kernels queued before that read the old buffer, and the
// kernels queued after wait for the copy. Nothing waits on the host.
pykv_status kv_device_resize(int device, void **p, size_t old_bytes, size_t new_bytes) {
    PYKV_TRY(cuda_set_device(device));   // the thread growing the list may not have chosen it
    if (new_bytes == 0) {
        cuda_free_async(*p, NULL);
        *p = NULL;
        return PYKV_OK;
    }
    void *q = NULL;
    PYKV_TRY(cuda_alloc_async(&q, new_bytes, NULL, "the KV cache"));
    const size_t keep = old_bytes < new_bytes ? old_bytes : new_bytes;
    if (*p && keep) {
        const pykv_status st = cuda_copy_d2d(q, *p, keep, NULL);
        if (st != PYKV_OK) {
            cuda_free_async(q, NULL);
            return st;
        }
    }
    cuda_free_async(*p, NULL);
    *p = q;
    return PYKV_OK;
}

pykv_status kv_device_read(void *dst, const void *d_src, size_t bytes) { return cuda_download(dst, d_src, bytes); }
pykv_status kv_device_write(void *d_dst, const void *src, size_t bytes) { return cuda_upload(d_dst, src, bytes); }

#else

static pykv_status no_cuda(void) {
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status kv_device_resize(int device, void **p, size_t old_bytes, size_t new_bytes) {
    (void)device; (void)p; (void)old_bytes; (void)new_bytes;
    return no_cuda();
}
pykv_status kv_device_read(void *dst, const void *d_src, size_t bytes) {
    (void)dst; (void)d_src; (void)bytes;
    return no_cuda();
}
pykv_status kv_device_write(void *d_dst, const void *src, size_t bytes) {
    (void)d_dst; (void)src; (void)bytes;
    return no_cuda();
}

#endif
