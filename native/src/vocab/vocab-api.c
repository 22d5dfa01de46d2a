// vocab-api.c - the public tokenizer functions of pykv.h: argument checks, then vocab.c.
#include "core/error.h"
#include "model/model.h"
#include "vocab/vocab.h"

static const struct vocab *get_vocab(const pykv_model *model, const char *fn) {
    if (!model) {
        pykv_error(PYKV_ERR_INVALID_ARG, "%s: model is NULL", fn);
        return NULL;
    }
    return model_vocab(model);
}

#define VOCAB_OR(fn, fallback)                    \
    const struct vocab *v = get_vocab(model, fn); \
    if (!v) return fallback

int32_t pykv_vocab_n_tokens(const pykv_model *model) {
    VOCAB_OR("pykv_vocab_n_tokens", 0);
    return vocab_n_tokens(v);
}

pykv_token pykv_vocab_bos(const pykv_model *model) {
    VOCAB_OR("pykv_vocab_bos", -1);
    return vocab_bos(v);
}

pykv_token pykv_vocab_eos(const pykv_model *model) {
    VOCAB_OR("pykv_vocab_eos", -1);
    return vocab_eos(v);
}

pykv_token pykv_vocab_eot(const pykv_model *model) {
    VOCAB_OR("pykv_vocab_eot", -1);
    return vocab_eot(v);
}

int32_t pykv_vocab_is_eog(const pykv_model *model, pykv_token token) {
    VOCAB_OR("pykv_vocab_is_eog", 0);
    return vocab_is_eog(v, token);
}

int32_t pykv_vocab_is_control(const pykv_model *model, pykv_token token) {
    VOCAB_OR("pykv_vocab_is_control", 0);
    return vocab_is_control(v, token);
}

int32_t pykv_vocab_add_bos(const pykv_model *model) {
    VOCAB_OR("pykv_vocab_add_bos", 0);
    return vocab_add_bos(v);
}

pykv_status pykv_tokenize(const pykv_model *model, const char *text, int32_t text_len, int32_t add_special,
                          int32_t parse_special, pykv_token *tokens, int32_t cap, int32_t *n_out) {
    if (n_out) *n_out = 0;
    VOCAB_OR("pykv_tokenize", PYKV_ERR_INVALID_ARG);
    return vocab_tokenize(v, text, text_len, add_special != 0, parse_special != 0, tokens, cap, n_out);
}

pykv_status pykv_token_to_piece(const pykv_model *model, pykv_token token, int32_t special, char *buf,
                                int32_t cap, int32_t *n_out) {
    if (n_out) *n_out = 0;
    VOCAB_OR("pykv_token_to_piece", PYKV_ERR_INVALID_ARG);
    return vocab_token_to_piece(v, token, special != 0, buf, cap, n_out);
}

pykv_status pykv_detokenize(const pykv_model *model, const pykv_token *tokens, int32_t n_tokens,
                            int32_t special, char *buf, int32_t cap, int32_t *n_out) {
    if (n_out) *n_out = 0;
    VOCAB_OR("pykv_detokenize", PYKV_ERR_INVALID_ARG);
    return vocab_detokenize(v, tokens, n_tokens, special != 0, buf, cap, n_out);
}
