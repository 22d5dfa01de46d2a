// kvzip.h - what KVzip's CPU path (kvzip.c) asks of the GPU (kvzip-gpu.c).
#pragma once
#include <stdint.h>
#include "kv/policy.h"

// One reconstruction pass over a layer on the GPU (ev->q_device, its T rows): for each query
// head h and chunk entry j, best[h * width + j] = the largest weight of pass_row's restricted
// softmax (the sinks [0, sink[g]), the chunk [c0[g], c0[g] + width), the pass's own entries
// from self0[g]) over the rows; host arrays. *done is 0 when the device cannot take it.
pykv_status kvzip_pass_device(const struct policy_event *ev, const int32_t *sink, const int32_t *c0,
                              const int32_t *self0, int32_t width, float *best, int *done);
