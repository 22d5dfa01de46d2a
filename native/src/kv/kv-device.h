// kv-device.h - GPU memory for the keys and values of the lists of offloaded layers (a
// kv_list with on_device set): kv-cache.c grows, shrinks and frees them through these, and a
// saved state copies them through host memory. Positions and the rest of a list's
// bookkeeping stay in host memory. A build without CUDA has no device lists; there these
// calls fail with PYKV_ERR_UNSUPPORTED.
#pragma once
#include <stddef.h>
#include "pykv.h"

// All three run on the context's stream s (a cuda_stream), after the kernels queued there.
// *p becomes a buffer of new_bytes on CUDA device `device` holding the first min(old_bytes, new_bytes) bytes
// of the old one (freed); new_bytes == 0 frees it and sets *p to NULL. On failure *p is
// unchanged.
pykv_status kv_device_resize(int device, void *s, void **p, size_t old_bytes, size_t new_bytes);
pykv_status kv_device_read(void *s, void *dst, const void *d_src, size_t bytes);
pykv_status kv_device_write(void *s, void *d_dst, const void *src, size_t bytes);
