// kv-device.h - GPU memory for the keys and values of the lists of offloaded layers (a
// kv_list with on_device set): kv-cache.c grows, shrinks and frees them through these, and a
// saved state copies them through host memory. Positions and the rest of a list's
// bookkeeping stay in host memory. A build without CUDA has no device lists; there these
// calls fail with PYKV_ERR_UNSUPPORTED.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "pykv.h"

// All three run on the context's stream s (a cuda_stream), after the kernels queued there.
// *p becomes a buffer of new_bytes on CUDA device `device` holding the first min(old_bytes, new_bytes) bytes
// of the old one (freed); new_bytes == 0 frees it and sets *p to NULL. On failure *p is
// unchanged.
pykv_status kv_device_resize(int device, void *s, void **p, size_t old_bytes, size_t new_bytes);
pykv_status kv_device_read(void *s, void *dst, const void *d_src, size_t bytes);
// Eviction from a device list (kv_list_retain, kv_list_drop), on stream s:
// moves[0..n) in order, each len rows from row src to row dst <= src of the buffer, in place
// (a few runs: a decode step's eviction, which keeps the list's room);
struct kv_row_move { int32_t dst, src, len; };
pykv_status kv_device_move_rows(void *s, void *d_base, size_t row_bytes, const struct kv_row_move *moves, int n);
// A decode step's evictions over every list in one launch: between kv_device_hold_moves(s)
// and kv_device_send_moves(s), which sends them and stops holding, kv_device_move_rows on s
// holds its moves back (a buffer's earlier moves are sent before it takes more). Every other
// call here on s, kv_device_layer and kv_batch_run send what is held first
// (kv_device_flush_moves), so what reads or reallocates the lists sees them moved.
void        kv_device_hold_moves(void *s);
pykv_status kv_device_flush_moves(void *s);
pykv_status kv_device_send_moves(void *s);
// or rows keep[0..n_keep) of *k (rows of kb bytes) and of *v (vb bytes) gathered into new
// buffers of `rows` rows each, which replace them (the old ones are freed): a compaction
// that gives memory back. On failure *k and *v are unchanged.
pykv_status kv_device_gather(int device, void *s, void **k, size_t kb, void **v, size_t vb, const int32_t *keep,
                             int32_t n_keep, int32_t rows);
// The same with keep in device memory (read by the stream's kernels: the caller frees it on
// the stream after).
pykv_status kv_device_gather_indices(int device, void *s, void **k, size_t kb, void **v, size_t vb,
                                     const int32_t *d_keep, int32_t n_keep, int32_t rows);
pykv_status kv_device_write(void *s, void *d_dst, const void *src, size_t bytes);

#ifdef PYKV_CUDA
// The lists of one layer as the CUDA kernels take them (ggml-cuda/kernels.h): their buffers,
// merged entries and current lengths, or with d_lens set the device array the kernels read
// the lengths from when they run.
struct kv_cache;
struct cuda_kv_layer;
void kv_device_layer(const struct kv_cache *c, int layer, const int32_t *d_lens, struct cuda_kv_layer *out);
#endif
