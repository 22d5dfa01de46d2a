// model.h - hyperparameters and weights of a `llama`-architecture GGUF (Llama, Mistral).
#pragma once
#include <stdint.h>
#include "model/gguf.h"
#include "pykv.h"
#include "vocab/vocab.h"

struct tensor {
    const void *data;   // in the mapped file
    int32_t     type;   // pykv_type
    int64_t     ne[2];  // ne[0] = row length (input features), ne[1] = rows (output features)
};

struct hparams {
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_rot;          // rotated dims per head (== head_dim for llama)
    int32_t n_ff;
    float   rope_freq_base;
    float   rms_eps;
};

struct layer_weights {
    float        *attn_norm;   // (n_embd), float32 copy
    struct tensor wq;          // (n_embd) -> (n_head * head_dim)
    struct tensor wk;          // (n_embd) -> (n_head_kv * head_dim)
    struct tensor wv;          // (n_embd) -> (n_head_kv * head_dim)
    struct tensor wo;          // (n_head * head_dim) -> (n_embd)
    float        *ffn_norm;    // (n_embd), float32 copy
    struct tensor w_gate;      // (n_embd) -> (n_ff)
    struct tensor w_up;        // (n_embd) -> (n_ff)
    struct tensor w_down;      // (n_ff) -> (n_embd)
};

struct pykv_model {
    struct gguf_file     *file;
    struct vocab         *vocab;
    struct hparams        hp;
    int                   vocab_only;
    int                   tied_output;
    struct tensor         tok_embd;     // (n_embd) x n_vocab rows
    float                *output_norm;  // (n_embd), float32 copy
    struct tensor         output;       // (n_embd) -> (n_vocab); tok_embd when tied
    float                *rope_freqs;   // (head_dim/2) frequency factors, or NULL
    struct layer_weights *layers;       // (n_layer)
    struct model_gpu     *gpu;          // the offloaded layers (model/offload.h), or NULL
};

const struct vocab *model_vocab(const pykv_model *model);
