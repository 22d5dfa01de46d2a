// take-evict-gpu.h - TAKE's eviction of a layer on the GPU that does not wait for the device
// (take-evict-gpu.c): the probe's scores, each list's top k and the compaction are queued on
// the cache's stream, and only the kept entries' indices come back, into pinned memory, for
// the host's positions, which take_deferred_finish writes once the chunk's work is done. The
// lists' lengths, room and byte counts change at once, as kv_list_retain's would, so the
// cache's size (and its peak) goes as on the CPU.
#pragma once
#include <stdint.h>
#include "kv/policy.h"

struct take_deferred;   // the chunk's lists whose positions wait for their indices

// Evict ev->layer on the GPU (every list with more than k candidates keeps its top k and the
// probe's entries after them) by the mixed probe d_qa (device, rows at pos0...), queued; *dp
// is made when first needed. The scores and the kept sets are take_layer_scores_device's and
// ws_select_top's. *done is 0 (and nothing queued) when a list would not compact
// (kv_list_retain_gathers): the caller evicts it the waiting way.
pykv_status take_deferred_evict(struct take_deferred **dp, const struct policy_event *ev, const float *d_qa,
                                int32_t rows, int32_t pos0, int32_t kernel, int32_t k, int *done);

// Waits for the cache's stream and writes the positions of every list evicted since the last
// call. NULL is fine.
pykv_status take_deferred_finish(struct take_deferred *d, struct kv_cache *c);
void        take_deferred_free(struct take_deferred *d);
