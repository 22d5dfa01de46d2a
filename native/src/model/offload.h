// offload.h - the model's layers on the GPU (pykv_model_params.n_gpu_layers): a device copy
// of the weights of the last n layers, and of the output norm and classifier when asked, as
// llama.cpp's -ngl splits a model. The host weights stay mapped, so a context may still run
// any layer on the CPU.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "model/model.h"

// A weight in GPU memory, in a type the CUDA matrix kernels read: the file's own type, or
// F16 for the types they do not (converted at load).
struct gpu_tensor {
    void   *data;
    int32_t type;
    int64_t ne[2];   // as struct tensor: ne[0] input features, ne[1] output features
};

struct gpu_layer {
    float            *attn_norm, *ffn_norm;   // (n_embd) floats
    struct gpu_tensor wq, wk, wv, wo, w_gate, w_up, w_down;
    // When the parts share a quantised type, they are stored back to back and these name the
    // whole (rows q, then k, then v; gate, then up), so a decode step takes one product for
    // each group; data is NULL otherwise.
    struct gpu_tensor wqkv, w_gate_up;
};

struct model_gpu {
    int               device;        // the CUDA device
    int               first_layer;   // layers [first_layer, n_layer) are here
    int               output;        // the output norm and classifier are here too
    void             *arena;         // one allocation holds every tensor below
    size_t            bytes;
    struct gpu_layer *layers;        // (n_layer - first_layer)
    float            *output_norm;
    struct gpu_tensor out;
};

// Put the last n_gpu_layers layers on device main_gpu (-1 or more than n_layer: all, and the
// classifier). A build without CUDA, or no GPU, leaves model->gpu NULL with a warning in the
// log (pykv_model_info.n_gpu_layers then reads 0). Not enough GPU memory is an error naming
// what was needed, raised before anything is copied.
pykv_status model_offload(pykv_model *m, int32_t n_gpu_layers, int32_t main_gpu);
void        model_offload_free(pykv_model *m);

// The layer's device weights, or NULL when it runs on the CPU.
static inline const struct gpu_layer *model_gpu_layer(const pykv_model *m, int layer) {
    return m->gpu && layer >= m->gpu->first_layer ? &m->gpu->layers[layer - m->gpu->first_layer] : NULL;
}
