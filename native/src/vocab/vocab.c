// vocab.c - loading a vocabulary from GGUF metadata, special tokens, and the parts shared by
// both tokenizers: splitting text on special tokens, token_to_piece and detokenize.
#include "vocab/vocab.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "vocab/unicode.h"
#include "vocab/vocab-impl.h"

// ---- token text hash map ----

static uint32_t hash_bytes(const char *s, int32_t len) {
    uint32_t h = 2166136261u;  // FNV-1a
    for (int32_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

pykv_token vocab_text_to_token(const struct vocab *v, const char *text, int32_t len) {
    const struct vocab_text_map *m = &v->text_map;
    for (uint32_t i = hash_bytes(text, len) & m->mask;; i = (i + 1) & m->mask) {
        int32_t id = m->slots[i];
        if (id < 0) return -1;
        const struct vocab_token *t = &v->tokens[id];
        if (t->len == len && memcmp(t->text, text, (size_t)len) == 0) return id;
    }
}

static pykv_status build_text_map(struct vocab *v) {
    uint32_t cap = 16;
    while (cap < (uint32_t)v->n_tokens * 2u) cap <<= 1;
    v->text_map.mask = cap - 1;
    v->text_map.slots = malloc(sizeof(int32_t) * cap);
    if (!v->text_map.slots) return pykv_error(PYKV_ERR_NOMEM, "vocab: out of memory for the token map");
    memset(v->text_map.slots, 0xff, sizeof(int32_t) * cap);
    for (int32_t id = 0; id < v->n_tokens; id++) {
        const struct vocab_token *t = &v->tokens[id];
        uint32_t i = hash_bytes(t->text, t->len) & v->text_map.mask;
        for (;; i = (i + 1) & v->text_map.mask) {
            int32_t other = v->text_map.slots[i];
            if (other < 0) { v->text_map.slots[i] = id; break; }
            const struct vocab_token *o = &v->tokens[other];
            if (o->len == t->len && memcmp(o->text, t->text, (size_t)t->len) == 0) break;  // keep the first
        }
    }
    return PYKV_OK;
}

pykv_status vocab_tokvec_push(struct vocab_tokvec *tv, pykv_token t) {
    if (tv->n == tv->cap) {
        if (tv->cap > INT32_MAX / 2) return pykv_error(PYKV_ERR_NOMEM, "tokenize: too many tokens");
        int32_t cap = tv->cap ? tv->cap * 2 : 64;
        pykv_token *d = realloc(tv->data, sizeof(pykv_token) * (size_t)cap);
        if (!d) return pykv_error(PYKV_ERR_NOMEM, "tokenize: out of memory");
        tv->data = d;
        tv->cap = cap;
    }
    tv->data[tv->n++] = t;
    return PYKV_OK;
}

// ---- loading ----

static pykv_status load_tokens(struct vocab *v, const struct gguf_file *f) {
    const struct gguf_kv *toks = NULL, *scores = NULL, *types = NULL;
    PYKV_TRY(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, 1, &toks));
    PYKV_TRY(gguf_get_arr(f, "tokenizer.ggml.scores", -1, 0, &scores));
    PYKV_TRY(gguf_get_arr(f, "tokenizer.ggml.token_type", -1, 0, &types));
    if (toks->arr_n == 0 || toks->arr_n > INT32_MAX / 4)
        return pykv_error(PYKV_ERR_FORMAT, "tokenizer.ggml.tokens: bad token count %llu",
                          (unsigned long long)toks->arr_n);
    int32_t n = (int32_t)toks->arr_n;
    if (scores && (scores->arr_n != toks->arr_n || scores->arr_type == GGUF_TYPE_STRING || scores->arr_type == GGUF_TYPE_ARRAY))
        return pykv_error(PYKV_ERR_FORMAT, "tokenizer.ggml.scores: %llu numbers expected, one per token",
                          (unsigned long long)toks->arr_n);
    if (types && (types->arr_n != toks->arr_n || types->arr_type == GGUF_TYPE_STRING || types->arr_type == GGUF_TYPE_ARRAY))
        return pykv_error(PYKV_ERR_FORMAT, "tokenizer.ggml.token_type: %llu integers expected, one per token",
                          (unsigned long long)toks->arr_n);
    uint64_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (toks->arr_strs[i].len > INT32_MAX / 2)
            return pykv_error(PYKV_ERR_FORMAT, "tokenizer.ggml.tokens: token %d is too long", i);
        total += toks->arr_strs[i].len;
    }
    v->n_tokens = n;
    v->tokens = calloc((size_t)n, sizeof(*v->tokens));
    v->arena = malloc((size_t)total + 1);
    if (!v->tokens || !v->arena) return pykv_error(PYKV_ERR_NOMEM, "vocab: out of memory for %d tokens", n);
    char *p = v->arena;
    for (int32_t i = 0; i < n; i++) {
        struct vocab_token *t = &v->tokens[i];
        t->len = (int32_t)toks->arr_strs[i].len;
        if (t->len) memcpy(p, toks->arr_strs[i].ptr, (size_t)t->len);
        t->text = p;
        p += t->len;
        t->score = scores ? (float)gguf_arr_float(scores, (uint64_t)i) : 0.0f;
        int64_t type = types ? gguf_arr_int(types, (uint64_t)i) : TOKEN_NORMAL;
        t->type = (type >= TOKEN_NORMAL && type <= TOKEN_BYTE) ? (int32_t)type : TOKEN_NORMAL;
        t->byte = -1;
    }
    return PYKV_OK;
}

static pykv_status get_token_id(const struct gguf_file *f, struct vocab *v, const char *key, pykv_token *out) {
    int64_t id = -2;
    PYKV_TRY(gguf_get_int(f, key, 0, &id));
    if (id == -2) return PYKV_OK;                       // absent: keep the default
    *out = (id >= 0 && id < v->n_tokens) ? (pykv_token)id : -1;  // out of range: none
    return PYKV_OK;
}

// Texts that end a turn, as llama.cpp recognises them when the metadata does not say.
static const char *const eot_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "<end_of_utterance>",
};
static const char *const eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
};
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static pykv_token find_text(const struct vocab *v, const char *s) {
    return vocab_text_to_token(v, s, (int32_t)strlen(s));
}

static pykv_status add_eog(struct vocab *v, pykv_token t) {
    if (t < 0) return PYKV_OK;
    for (int32_t i = 0; i < v->n_eog; i++)
        if (v->eog[i] == t) return PYKV_OK;
    pykv_token *e = realloc(v->eog, sizeof(pykv_token) * (size_t)(v->n_eog + 1));
    if (!e) return pykv_error(PYKV_ERR_NOMEM, "vocab: out of memory");
    v->eog = e;
    v->eog[v->n_eog++] = t;
    return PYKV_OK;
}

static pykv_status load_special_ids(struct vocab *v, const struct gguf_file *f) {
    v->bos = v->eos = v->eot = v->eom = v->unk = v->pad = -1;
    if (v->kind == VOCAB_SPM) {
        v->bos = v->n_tokens > 1 ? 1 : -1;
        v->eos = v->n_tokens > 2 ? 2 : -1;
        v->unk = 0;
    }
    PYKV_TRY(get_token_id(f, v, "tokenizer.ggml.bos_token_id", &v->bos));
    PYKV_TRY(get_token_id(f, v, "tokenizer.ggml.eos_token_id", &v->eos));
    PYKV_TRY(get_token_id(f, v, "tokenizer.ggml.eot_token_id", &v->eot));
    PYKV_TRY(get_token_id(f, v, "tokenizer.ggml.eom_token_id", &v->eom));
    PYKV_TRY(get_token_id(f, v, "tokenizer.ggml.unknown_token_id", &v->unk));
    PYKV_TRY(get_token_id(f, v, "tokenizer.ggml.padding_token_id", &v->pad));
    for (int i = 0; v->eot < 0 && i < N_OF(eot_texts); i++) v->eot = find_text(v, eot_texts[i]);
    if (v->eom < 0) v->eom = find_text(v, "<|eom_id|>");

    v->add_bos = v->kind == VOCAB_SPM || v->pre == VOCAB_PRE_LLAMA3;
    v->add_eos = 0;
    v->add_space_prefix = v->kind == VOCAB_SPM;
    PYKV_TRY(gguf_get_bool(f, "tokenizer.ggml.add_bos_token", 0, &v->add_bos));
    PYKV_TRY(gguf_get_bool(f, "tokenizer.ggml.add_eos_token", 0, &v->add_eos));
    if (v->kind == VOCAB_SPM) PYKV_TRY(gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", 0, &v->add_space_prefix));
    if (v->bos < 0) v->add_bos = 0;
    if (v->eos < 0) v->add_eos = 0;

    PYKV_TRY(add_eog(v, v->eos));
    PYKV_TRY(add_eog(v, v->eot));
    PYKV_TRY(add_eog(v, v->eom));
    for (int i = 0; i < N_OF(eog_texts); i++) PYKV_TRY(add_eog(v, find_text(v, eog_texts[i])));
    return PYKV_OK;
}

// Sort key of a special token: first byte ascending, then length descending, then id.
struct special_key {
    int32_t first, len, id;
};

static int cmp_special(const void *a, const void *b) {
    const struct special_key *x = a, *y = b;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

static int is_special_type(int32_t type) {
    return type == TOKEN_CONTROL || type == TOKEN_USER_DEFINED || type == TOKEN_UNKNOWN;
}

static pykv_status index_special(struct vocab *v) {
    int32_t n = 0;
    for (int32_t i = 0; i < v->n_tokens; i++)
        if (is_special_type(v->tokens[i].type) && v->tokens[i].len > 0) n++;
    struct special_key *keys = malloc(sizeof(*keys) * (size_t)(n ? n : 1));
    v->special = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!keys || !v->special) {
        free(keys);
        return pykv_error(PYKV_ERR_NOMEM, "vocab: out of memory");
    }
    n = 0;
    for (int32_t i = 0; i < v->n_tokens; i++) {
        const struct vocab_token *t = &v->tokens[i];
        if (is_special_type(t->type) && t->len > 0)
            keys[n++] = (struct special_key){(unsigned char)t->text[0], t->len, i};
    }
    qsort(keys, (size_t)n, sizeof(*keys), cmp_special);
    for (int32_t i = 0; i < n; i++) v->special[i] = keys[i].id;
    free(keys);
    v->n_special = n;
    int32_t k = 0;
    for (int b = 0; b <= 256; b++) {
        while (b < 256 && k < n && (unsigned char)v->tokens[v->special[k]].text[0] < b) k++;
        v->special_start[b] = b < 256 ? k : n;
    }
    return PYKV_OK;
}

pykv_status vocab_load(const struct gguf_file *f, struct vocab **out) {
    *out = NULL;
    struct vocab *v = calloc(1, sizeof(*v));
    if (!v) return pykv_error(PYKV_ERR_NOMEM, "vocab: out of memory");
    struct gguf_str model = {0};
    pykv_status st = gguf_get_str(f, "tokenizer.ggml.model", 1, &model);
    if (st != PYKV_OK) goto fail;
    if (gguf_str_eq(model, "llama")) v->kind = VOCAB_SPM;
    else if (gguf_str_eq(model, "gpt2")) v->kind = VOCAB_BPE;
    else {
        st = pykv_error(PYKV_ERR_UNSUPPORTED, "tokenizer.ggml.model '%.*s' is not supported "
                        "(pykv reads 'llama' SentencePiece and 'gpt2' BPE vocabularies)",
                        (int)(model.len > 64 ? 64 : model.len), model.ptr);
        goto fail;
    }
    if ((st = load_tokens(v, f)) != PYKV_OK) goto fail;
    if ((st = build_text_map(v)) != PYKV_OK) goto fail;
    st = v->kind == VOCAB_BPE ? vocab_bpe_init(v, f) : vocab_spm_init(v);
    if (st != PYKV_OK) goto fail;
    if ((st = load_special_ids(v, f)) != PYKV_OK) goto fail;
    if ((st = index_special(v)) != PYKV_OK) goto fail;
    *out = v;
    return PYKV_OK;
fail:
    vocab_free(v);
    return st;
}

void vocab_free(struct vocab *v) {
    if (!v) return;
    free(v->tokens);
    free(v->arena);
    free(v->text_map.slots);
    free(v->eog);
    free(v->special);
    free(v->merges.slots);
    free(v);
}

// ---- queries ----

int32_t    vocab_n_tokens(const struct vocab *v) { return v->n_tokens; }
pykv_token vocab_bos(const struct vocab *v) { return v->bos; }
pykv_token vocab_eos(const struct vocab *v) { return v->eos; }
pykv_token vocab_eot(const struct vocab *v) { return v->eot; }
int        vocab_add_bos(const struct vocab *v) { return v->add_bos; }

int vocab_is_eog(const struct vocab *v, pykv_token t) {
    for (int32_t i = 0; i < v->n_eog; i++)
        if (v->eog[i] == t) return 1;
    return 0;
}

int vocab_is_control(const struct vocab *v, pykv_token t) {
    return t >= 0 && t < v->n_tokens && v->tokens[t].type == TOKEN_CONTROL;
}

// ---- tokenize ----

static pykv_status tokenize_raw(const struct vocab *v, const char *text, int32_t len, int prev_special,
                                struct vocab_tokvec *out) {
    if (v->kind == VOCAB_SPM) return vocab_spm_tokenize(v, text, len, v->add_space_prefix && prev_special, out);
    return len > 0 ? vocab_bpe_tokenize(v, text, len, out) : PYKV_OK;
}

// The special token starting at text[i] (leftmost-longest), or -1. Control and unknown
// tokens only count when parse_special; user-defined tokens always do (as in llama.cpp).
static pykv_token special_at(const struct vocab *v, const char *text, int32_t len, int32_t i, int parse_special) {
    unsigned char b = (unsigned char)text[i];
    for (int32_t k = v->special_start[b]; k < v->special_start[b + 1]; k++) {
        const struct vocab_token *t = &v->tokens[v->special[k]];
        if (!parse_special && t->type != TOKEN_USER_DEFINED) continue;
        if (t->len <= len - i && memcmp(t->text, text + i, (size_t)t->len) == 0) return v->special[k];
    }
    return -1;
}

static pykv_status tokenize_all(const struct vocab *v, const char *text, int32_t len, int add_special,
                                int parse_special, struct vocab_tokvec *out) {
    if (add_special && v->add_bos) PYKV_TRY(vocab_tokvec_push(out, v->bos));
    int prev_special = 1;
    int32_t start = 0;
    for (int32_t i = 0; i < len;) {
        pykv_token t = v->n_special ? special_at(v, text, len, i, parse_special) : -1;
        if (t < 0) { i++; continue; }
        if (i > start) PYKV_TRY(tokenize_raw(v, text + start, i - start, prev_special, out));
        PYKV_TRY(vocab_tokvec_push(out, t));
        prev_special = 1;
        i += v->tokens[t].len;
        start = i;
    }
    if (len > start) PYKV_TRY(tokenize_raw(v, text + start, len - start, prev_special, out));
    if (add_special && v->add_eos) PYKV_TRY(vocab_tokvec_push(out, v->eos));
    return PYKV_OK;
}

pykv_status vocab_tokenize(const struct vocab *v, const char *text, int32_t text_len, int add_special,
                           int parse_special, pykv_token *out, int32_t cap, int32_t *n_out) {
    if (!n_out) return pykv_error(PYKV_ERR_INVALID_ARG, "tokenize: n_out is NULL");
    *n_out = 0;
    if (text_len < 0) return pykv_error(PYKV_ERR_INVALID_ARG, "tokenize: negative text length %d", text_len);
    if (!text && text_len > 0) return pykv_error(PYKV_ERR_INVALID_ARG, "tokenize: text is NULL but text_len is %d", text_len);
    if (cap < 0 || (!out && cap > 0))
        return pykv_error(PYKV_ERR_INVALID_ARG, "tokenize: bad output buffer (tokens %s, cap %d)", out ? "set" : "NULL", cap);
    struct vocab_tokvec tv = {0};
    pykv_status st = tokenize_all(v, text, text_len, add_special, parse_special, &tv);
    if (st == PYKV_OK) {
        *n_out = tv.n;
        if (tv.n > cap)
            st = pykv_error(PYKV_ERR_BUFFER_TOO_SMALL, "tokenize: %d tokens do not fit in a buffer of %d", tv.n, cap);
        else if (tv.n)
            memcpy(out, tv.data, sizeof(pykv_token) * (size_t)tv.n);
    }
    free(tv.data);
    return st;
}

// ---- pieces ----

// Copy src into buf as far as avail allows, skipping one leading space if lstrip; returns
// the full length of the piece.
static int32_t copy_piece(const char *src, int32_t len, int lstrip, char *buf, int32_t avail) {
    if (lstrip && len > 0 && src[0] == ' ') { src++; len--; }
    if (avail > 0) memcpy(buf, src, (size_t)(len < avail ? len : avail));
    return len;
}

// SPM text: U+2581 (e2 96 81) is a space.
static int32_t spm_unescape(const char *s, int32_t len, int lstrip, char *buf, int32_t avail) {
    int32_t need = 0;
    for (int32_t i = 0; i < len;) {
        char c;
        if (i + 2 < len && (unsigned char)s[i] == 0xE2 && (unsigned char)s[i + 1] == 0x96 && (unsigned char)s[i + 2] == 0x81) {
            c = ' ';
            i += 3;
        } else {
            c = s[i++];
        }
        if (lstrip && need == 0 && c == ' ') { lstrip = 0; continue; }
        lstrip = 0;
        if (need < avail) buf[need] = c;
        need++;
    }
    return need;
}

static int32_t piece_of(const struct vocab *v, pykv_token t, int special, int lstrip, char *buf, int32_t avail) {
    const struct vocab_token *tok = &v->tokens[t];
    switch (tok->type) {
    case TOKEN_CONTROL:
        return special ? copy_piece(tok->text, tok->len, lstrip, buf, avail) : 0;
    case TOKEN_USER_DEFINED:
        return copy_piece(tok->text, tok->len, lstrip, buf, avail);
    case TOKEN_UNUSED:
        return 0;
    case TOKEN_UNKNOWN:
        if (v->kind == VOCAB_SPM) return copy_piece("\xe2\x96\x85", 3, 0, buf, avail);  // U+2585 as llama.cpp
        return special ? copy_piece(tok->text, tok->len, lstrip, buf, avail) : 0;
    case TOKEN_BYTE:
        if (tok->byte >= 0) {
            char c = (char)tok->byte;
            return copy_piece(&c, 1, 0, buf, avail);
        }
        break;
    default:
        break;
    }
    if (v->kind == VOCAB_SPM) return spm_unescape(tok->text, tok->len, lstrip, buf, avail);
    int32_t need = 0;  // BPE: lstrip never applies (add_space_prefix is an SPM setting)
    vocab_bpe_decode_text(tok->text, tok->len, buf, avail, &need);
    return need;
}

pykv_status vocab_token_to_piece(const struct vocab *v, pykv_token t, int special, char *buf,
                                 int32_t cap, int32_t *n_out) {
    if (!n_out) return pykv_error(PYKV_ERR_INVALID_ARG, "token_to_piece: n_out is NULL");
    *n_out = 0;
    if (t < 0 || t >= v->n_tokens)
        return pykv_error(PYKV_ERR_INVALID_ARG, "token_to_piece: token %d is out of range [0, %d)", t, v->n_tokens);
    if (cap < 0 || (!buf && cap > 0)) return pykv_error(PYKV_ERR_INVALID_ARG, "token_to_piece: bad buffer (cap %d)", cap);
    int32_t need = piece_of(v, t, special, 0, buf, cap);
    *n_out = need;
    if (need > cap)
        return pykv_error(PYKV_ERR_BUFFER_TOO_SMALL, "token_to_piece: %d bytes do not fit in a buffer of %d", need, cap);
    return PYKV_OK;
}

pykv_status vocab_detokenize(const struct vocab *v, const pykv_token *tokens, int32_t n, int special,
                             char *buf, int32_t cap, int32_t *n_out) {
    if (!n_out) return pykv_error(PYKV_ERR_INVALID_ARG, "detokenize: n_out is NULL");
    *n_out = 0;
    if (n < 0) return pykv_error(PYKV_ERR_INVALID_ARG, "detokenize: negative token count %d", n);
    if (!tokens && n > 0) return pykv_error(PYKV_ERR_INVALID_ARG, "detokenize: tokens is NULL but n_tokens is %d", n);
    if (cap < 0 || (!buf && cap > 0)) return pykv_error(PYKV_ERR_INVALID_ARG, "detokenize: bad buffer (cap %d)", cap);
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= v->n_tokens)
            return pykv_error(PYKV_ERR_INVALID_ARG, "detokenize: token %d at index %d is out of range [0, %d)",
                              tokens[i], i, v->n_tokens);
    // SentencePiece drops the space its dummy prefix put before the first piece of text.
    int strip = v->add_space_prefix;
    int64_t pos = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t avail = pos < cap ? (int32_t)(cap - pos) : 0;
        int32_t len = piece_of(v, tokens[i], special, strip, avail ? buf + pos : NULL, avail);
        int32_t type = v->tokens[tokens[i]].type;
        if (len > 0 || (type != TOKEN_CONTROL && type != TOKEN_UNUSED)) strip = 0;
        pos += len;
        if (pos > INT32_MAX) return pykv_error(PYKV_ERR_INVALID_ARG, "detokenize: the text exceeds 2 GiB");
    }
    *n_out = (int32_t)pos;
    if (pos > cap)
        return pykv_error(PYKV_ERR_BUFFER_TOO_SMALL, "detokenize: %lld bytes do not fit in a buffer of %d", (long long)pos, cap);
    return PYKV_OK;
}
