// timing.h - where a stream's GPU time goes, by stage of the forward pass (PYKV_CUDA_TIMINGS=1).
//
// The forward pass marks the start of each stage on its stream (a CUDA event); a stage's time
// is the stream's time from its mark to the next one, so time the GPU spent waiting for the
// host to queue the stage's work counts as the stage's. When the stream's context is freed,
// a table of the stages (calls, total, per call, share) goes to stderr. Marks made while the
// stream is recorded into a CUDA graph are left out: a replayed step is one stage
// (PYKV_CUDA_GRAPHS=0 splits a decode step by stage too). Without PYKV_CUDA_TIMINGS, or
// with it set to 0, every call here returns at once.
#pragma once
#include "ggml-cuda/device.h"

#ifdef __cplusplus
extern "C" {
#endif

int  cuda_timings_on(void);
// From here on, the work queued on s is stage's (a string that outlives the stream).
void cuda_timing_mark(cuda_stream s, const char *stage);
// Closes the open stage and adds up the stream's marks (it waits for them): call it where the
// host waits for the stream anyway.
void cuda_timing_end(cuda_stream s);
// Prints the stream's table under title to stderr and forgets the stream (before it is destroyed).
void cuda_timing_report(cuda_stream s, const char *title);

#ifdef __cplusplus
}
#endif
