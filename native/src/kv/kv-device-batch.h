// kv-device-batch.h - many small copies between host memory and device buffers (the rows of
// offloaded lists, their merged-entry blocks) sent together: one upload of the staged bytes
// and the copy list, one launch of a copy kernel per stage, one download, one wait. A decode
// step's changes to every offloaded list (EMS's merged rows, evictions and member counts)
// cost a few waits per step instead of a few per list.
//
// Stages run in order, the copies of one stage in any order: a move inside a buffer is a copy
// of its rows to the batch's scratch (KV_BATCH_GATHER) and back (KV_BATCH_SCATTER). A device
// end is named by the address of the pointer that holds the buffer (&list->k) and a byte
// offset, read when the batch runs, so a buffer reallocated in between is found where it is.
// A build without CUDA has no device lists: there kv_batch_run fails with PYKV_ERR_UNSUPPORTED.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "pykv.h"

// WRITE: staged bytes into place; GATHER, SCATTER: the two halves of a move; READ: what comes
// back, as the stages before left it.
enum kv_batch_stage { KV_BATCH_WRITE, KV_BATCH_GATHER, KV_BATCH_SCATTER, KV_BATCH_READ, KV_BATCH_STAGES };

struct kv_batch_copy {
    void *const *dst_ref, *const *src_ref;   // the buffers' pointers, read at kv_batch_run
    int64_t      dst_off, src_off, bytes;
    int32_t      stage;
};

struct kv_batch {
    int   device;
    void *stream;                        // the cache's stream (a cuda_stream)
    char *h_up;                          // pinned: staged bytes, then the copy list as the kernel reads it
    void *d_up;                          // device: as h_up
    void *d_scratch, *d_down;            // device: move scratch; the bytes to download
    char *h_down;                        // pinned: the downloaded bytes
    size_t up_cap, scratch_cap, down_cap;
    size_t up_used, scratch_used, down_used;
    struct kv_batch_copy *copies;        // host
    int32_t n_copies, copies_cap;
};

void kv_batch_init(struct kv_batch *b, int device, void *stream);
void kv_batch_free(struct kv_batch *b);
// Room for at least this much more before the next run, so that queuing then cannot fail
// (what was downloaded is not kept).
pykv_status kv_batch_reserve(struct kv_batch *b, size_t up_bytes, int32_t copies, size_t scratch_bytes,
                             size_t down_bytes);
// `bytes` to go to (*dst_ref + dst_off) at KV_BATCH_WRITE: returns where to write them (host
// memory, valid until the next call on the batch).
void *kv_batch_upload(struct kv_batch *b, void *const *dst_ref, int64_t dst_off, size_t bytes);
// rows [src, src + len) of the buffer *ref (rows of row_bytes) moved to rows [dst, dst + len).
pykv_status kv_batch_move(struct kv_batch *b, void *const *ref, size_t row_bytes, int32_t dst, int32_t src,
                          int32_t len);
// `bytes` of (*src_ref + src_off) brought to host memory: returns their offset for
// kv_batch_downloaded once the batch has run, or -1 when out of memory.
int64_t kv_batch_download(struct kv_batch *b, void *const *src_ref, int64_t src_off, size_t bytes);
static inline const void *kv_batch_downloaded(const struct kv_batch *b, int64_t at) { return b->h_down + at; }
// Runs everything queued on the stream and waits for it; the batch is empty after.
pykv_status kv_batch_run(struct kv_batch *b);
