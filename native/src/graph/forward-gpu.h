// forward-gpu.h - the offloaded layers of the forward pass (forward-gpu.c): the same steps as
// forward.c's CPU layer, run by the CUDA kernels (ggml-cuda/kernels.h) on device buffers.
// The offloaded layers are the model's last ones (model/offload.h), so a chunk's residual
// stream goes to the GPU once, before the first of them, and comes back once, after the last
// (or only the logits come back, when the classifier is there too).
#pragma once
#include "graph/context.h"

// Set up ctx->gpu when the model has layers on the GPU and this context can run them there:
// the device buffers, and the cache's lists of those layers in GPU memory. A context the GPU
// cannot serve (an evicting policy, exact products) runs every layer on the CPU and says so
// once (pykv_take_warning).
pykv_status gpu_run_init(pykv_context *ctx);
// After the cache is freed: the device buffers, and the memory the lists held.
void        gpu_run_free(pykv_context *ctx);

// The first layer the context runs on the GPU; n_layer when none.
int         gpu_first_layer(const pykv_context *ctx);

// Layers [gpu_first_layer, n_layer) over the chunk's T tokens (the last n_probe of them probe
// tokens), from the residual stream and RoPE table in ctx->buf. Afterwards the residual stream
// is back in ctx->buf.x when want_x, and when want_logits and the classifier is on the GPU
// the last token's logits are in ctx->logits (*logits_done = 1; 0 leaves them to the CPU).
pykv_status gpu_forward_layers(pykv_context *ctx, int T, int n_probe, int want_x, int want_logits, int *logits_done);
