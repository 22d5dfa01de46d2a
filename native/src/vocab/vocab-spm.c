// vocab-spm.c - SentencePiece BPE as llama.cpp's llm_tokenizer_spm does it: start from
// characters, repeatedly merge the adjacent pair whose union is the best-scoring token
// (leftmost on ties), and spell what is left over with byte tokens <0xXX>.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/heap.h"
#include "vocab/unicode.h"
#include "vocab/vocab-impl.h"

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

pykv_status vocab_spm_init(struct vocab *v) {
    for (int32_t id = 0; id < v->n_tokens; id++) {
        struct vocab_token *t = &v->tokens[id];
        if (t->type == TOKEN_BYTE && t->len == 6 && memcmp(t->text, "<0x", 3) == 0 && t->text[5] == '>') {
            int hi = hex_digit(t->text[3]), lo = hex_digit(t->text[4]);
            if (hi >= 0 && lo >= 0) t->byte = hi * 16 + lo;
        }
    }
    for (int b = 0; b < 256; b++) {
        char name[7];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        pykv_token t = vocab_text_to_token(v, name, 6);
        if (t < 0) {
            char c = (char)b;
            t = vocab_text_to_token(v, &c, 1);
        }
        v->byte_token[b] = t;  // -1: the tokenizer falls back to unk
    }
    return PYKV_OK;
}

// SentencePiece merges only into normal, user-defined and unused pieces.
static pykv_token mergeable(const struct vocab *v, const char *s, int32_t len) {
    pykv_token t = vocab_text_to_token(v, s, len);
    if (t < 0) return -1;
    int32_t type = v->tokens[t].type;
    return (type == TOKEN_NORMAL || type == TOKEN_USER_DEFINED || type == TOKEN_UNUSED) ? t : -1;
}

struct spm_sym {
    int32_t start, len;   // in the escaped text; len 0 once merged into its left neighbour
    int32_t prev, next;
};

struct spm_cand {
    float   score;
    int32_t left, right, len;
};

// The merge applied first: the highest score, then the leftmost.
static int cand_before(const void *pa, const void *pb) {
    const struct spm_cand *a = pa, *b = pb;
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void try_pair(const struct vocab *v, const char *s, const struct spm_sym *sym, struct spm_cand *heap,
                     int32_t *n_heap, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    int32_t len = sym[l].len + sym[r].len;
    pykv_token t = mergeable(v, s + sym[l].start, len);
    if (t >= 0) heap_push(heap, n_heap, &(struct spm_cand){v->tokens[t].score, l, r, len}, sizeof(struct spm_cand),
                          cand_before);
}

pykv_status vocab_spm_tokenize(const struct vocab *v, const char *text, int32_t len, int add_prefix,
                               struct vocab_tokvec *out) {
    // Escape: the optional dummy prefix, then every space as U+2581.
    int64_t n_esc = add_prefix ? 3 : 0;
    for (int32_t i = 0; i < len; i++) n_esc += text[i] == ' ' ? 3 : 1;
    if (n_esc == 0) return PYKV_OK;
    if (n_esc > INT32_MAX / 4) return pykv_error(PYKV_ERR_INVALID_ARG, "tokenize: text too long");
    char *s = malloc((size_t)n_esc);
    struct spm_sym *sym = malloc(sizeof(*sym) * (size_t)n_esc);
    struct spm_cand *heap = malloc(sizeof(struct spm_cand) * 3 * (size_t)n_esc);   // by cand_before
    int32_t n_heap = 0;
    pykv_status st = PYKV_OK;
    if (!s || !sym || !heap) {
        st = pykv_error(PYKV_ERR_NOMEM, "tokenize: out of memory for %d bytes of text", len);
        goto done;
    }
    int32_t n = 0;
    if (add_prefix) { memcpy(s, "\xe2\x96\x81", 3); n = 3; }
    for (int32_t i = 0; i < len; i++) {
        if (text[i] == ' ') { memcpy(s + n, "\xe2\x96\x81", 3); n += 3; }
        else s[n++] = text[i];
    }
    // One symbol per character; an invalid byte is a symbol of its own.
    int32_t n_sym = 0;
    for (int32_t i = 0; i < n;) {
        int k = unicode_seq_len(s + i, (size_t)(n - i));
        sym[n_sym] = (struct spm_sym){i, k, n_sym - 1, -1};
        if (n_sym > 0) sym[n_sym - 1].next = n_sym;
        n_sym++;
        i += k;
    }
    for (int32_t i = 0; i + 1 < n_sym; i++) try_pair(v, s, sym, heap, &n_heap, i, i + 1);
    while (n_heap > 0) {
        struct spm_cand c;
        heap_pop(heap, &n_heap, &c, sizeof(c), cand_before);
        struct spm_sym *l = &sym[c.left], *r = &sym[c.right];
        if (l->len == 0 || r->len == 0 || l->len + r->len != c.len || l->next != c.right) continue;
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = c.left;
        try_pair(v, s, sym, heap, &n_heap, l->prev, c.left);
        try_pair(v, s, sym, heap, &n_heap, c.left, l->next);
    }
    for (int32_t i = 0; i >= 0 && st == PYKV_OK; i = sym[i].next) {
        pykv_token t = mergeable(v, s + sym[i].start, sym[i].len);
        if (t >= 0) { st = vocab_tokvec_push(out, t); continue; }
        for (int32_t j = 0; j < sym[i].len && st == PYKV_OK; j++) {  // byte fallback
            pykv_token b = v->byte_token[(unsigned char)s[sym[i].start + j]];
            if (b < 0) b = v->unk;
            if (b >= 0) st = vocab_tokvec_push(out, b);
        }
    }
done:
    free(s);
    free(sym);
    free(heap);
    return st;
}
