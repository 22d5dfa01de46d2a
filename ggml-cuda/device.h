// device.h - the CUDA device as the C runtime sees it: whether there is one, its memory,
// copies, streams and errors. Pointers named d_* are device memory. Every call returns a
// pykv_status with a message (core/error.h) and never aborts; a CUDA build on a machine
// without a GPU or driver sees cuda_device_count() == 0.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "pykv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *cuda_stream;   // cudaStream_t; NULL is the default stream

// Usable devices: 0 when the driver is missing, too old or sees no GPU (never an error).
int         cuda_device_count(void);
// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB free of 79.6 GiB)" for device dev.
pykv_status cuda_device_describe(int dev, char *buf, size_t cap);
// Why cuda_device_count() is 0, for a warning ("no CUDA driver", ...); "" when it is not.
const char *cuda_unavailable_reason(void);
// Make dev the calling thread's current device.
pykv_status cuda_set_device(int dev);
pykv_status cuda_mem_info(size_t *free_bytes, size_t *total_bytes);

// bytes rounded up to 256: where a section of one device allocation may start (the sections
// of a work block, the buffers laid out one after another).
static inline size_t cuda_align(size_t bytes) { return (bytes + 255) / 256 * 256; }

pykv_status cuda_alloc(void **d_ptr, size_t bytes, const char *what);   // what: for the out-of-memory message
void        cuda_free(void *d_ptr);                                      // NULL is fine
// Stream-ordered allocation from the device's memory pool (no device-wide wait, so a KV list
// can grow between kernels cheaply): the memory may be used by work queued on s after the call,
// and is freed once the work queued before cuda_free_async is done. Freed memory stays in the
// pool for the next allocation until cuda_pool_trim gives back what no queued work still holds
// (synchronise the streams that freed it first).
pykv_status cuda_alloc_async(void **d_ptr, size_t bytes, cuda_stream s, const char *what);
void        cuda_free_async(void *d_ptr, cuda_stream s);
void        cuda_pool_trim(void);
pykv_status cuda_upload(void *d_dst, const void *src, size_t bytes);     // synchronous
pykv_status cuda_download(void *dst, const void *d_src, size_t bytes);   // synchronous
pykv_status cuda_copy_d2d(void *d_dst, const void *d_src, size_t bytes, cuda_stream s);
pykv_status cuda_upload_async(void *d_dst, const void *src, size_t bytes, cuda_stream s);
// The same for a few KiB from pageable memory, without the wait such a copy makes for the
// stream's queued work: the bytes are copied into pinned memory first (staged-upload.cu), so
// src may change or go as soon as it returns. Not for a stream being captured into a graph.
pykv_status cuda_upload_staged(void *d_dst, const void *src, size_t bytes, cuda_stream s);
pykv_status cuda_download_async(void *dst, const void *d_src, size_t bytes, cuda_stream s);
pykv_status cuda_memset(void *d_ptr, int value, size_t bytes, cuda_stream s);

// Pinned host memory: copies from it can be part of a CUDA graph, reading it when they run.
pykv_status cuda_host_alloc(void **p, size_t bytes);
void        cuda_host_free(void *p);

// CUDA graphs: the work queued on s between cuda_graph_capture_begin and cuda_graph_capture_end
// is recorded, not run; *exec becomes an executable graph of it (the one it held is updated in
// place when the new recording has the same shape, else replaced). A failed capture leaves
// *exec as it was and the stream usable.
typedef struct CUgraphExec_st *cuda_graph;
pykv_status cuda_graph_capture_begin(cuda_stream s);
pykv_status cuda_graph_capture_end(cuda_stream s, cuda_graph *exec);
pykv_status cuda_graph_launch(cuda_graph exec, cuda_stream s);
void        cuda_graph_free(cuda_graph exec);

// A stream with no implicit order with the legacy default stream (non-blocking).
pykv_status cuda_stream_create(cuda_stream *s);
void        cuda_stream_destroy(cuda_stream s);
pykv_status cuda_stream_sync(cuda_stream s);

// PYKV_OK, or the pending launch error (an invalid configuration, a fault) as an error
// naming `what`.
pykv_status cuda_check(const char *what);

#ifdef __cplusplus
}
#endif
