// outputs.h - what a decode call keeps of every token it evaluates, when asked: each
// token's logits (pykv_set_logits_all) and its final hidden state (pykv_set_embeddings).
#pragma once
#include <stdint.h>
#include "pykv.h"

struct token_outputs {
    int      logits_all;     // keep every token's logits
    int      embeddings;     // keep every token's hidden state after the output norm
    float   *logits;         // (cap_logits, n_vocab)
    float   *embd;           // (cap_embd, n_embd)
    int32_t  cap_logits, cap_embd;   // rows allocated
    int32_t  n;              // rows written by the current or last decode call
};

// Room for n_tokens rows of whatever is switched on; called before a decode call changes
// anything, so that running out of memory leaves the context as it was.
pykv_status outputs_reserve(struct token_outputs *o, int32_t n_tokens, int32_t n_vocab, int32_t n_embd);
void outputs_free(struct token_outputs *o);

// The rows of a chunk's first n tokens (its probe excluded), written at row o->n from the
// chunk's residual stream; forward_chunk calls it after the last layer.
struct pykv_context;
void outputs_write(struct pykv_context *ctx, int n);
