// vocab.h - tokenizers read from GGUF metadata: BPE (tokenizer.ggml.model "gpt2") and
// SentencePiece (tokenizer.ggml.model "llama"), special tokens, detokenization.
// A loaded vocab is immutable, so every function here is thread-safe.
#pragma once
#include <stdint.h>
#include "model/gguf.h"
#include "pykv.h"

struct vocab;

pykv_status vocab_load(const struct gguf_file *f, struct vocab **out);
void        vocab_free(struct vocab *v);

int32_t     vocab_n_tokens(const struct vocab *v);
pykv_token  vocab_bos(const struct vocab *v);   // -1 when none
pykv_token  vocab_eos(const struct vocab *v);
pykv_token  vocab_eot(const struct vocab *v);
int         vocab_is_eog(const struct vocab *v, pykv_token t);
int         vocab_is_control(const struct vocab *v, pykv_token t);
int         vocab_add_bos(const struct vocab *v);

// parse_special: control/unknown tokens' text becomes those tokens (leftmost, longest first);
// user-defined tokens are always matched, as in llama.cpp. Invalid UTF-8 never fails: each
// bad byte is a character of its own, spelled with its byte token (SPM <0xXX>, BPE byte
// character); a byte the BPE vocabulary cannot spell is dropped, as HF tokenizers does.
pykv_status vocab_tokenize(const struct vocab *v, const char *text, int32_t text_len, int add_special,
                           int parse_special, pykv_token *out, int32_t cap, int32_t *n_out);
pykv_status vocab_token_to_piece(const struct vocab *v, pykv_token t, int special, char *buf,
                                 int32_t cap, int32_t *n_out);
pykv_status vocab_detokenize(const struct vocab *v, const pykv_token *tokens, int32_t n, int special,
                             char *buf, int32_t cap, int32_t *n_out);
