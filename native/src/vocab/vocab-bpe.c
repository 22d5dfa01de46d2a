// vocab-bpe.c - GPT-2 style byte-level BPE: pre-tokenizer regexes emulated by hand-written
// matchers, the byte <-> character mapping, and rank-ordered merging with a binary heap.
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/heap.h"
#include "vocab/unicode.h"
#include "vocab/vocab-impl.h"

// ---- GPT-2 byte <-> character mapping ----
// Printable Latin-1 bytes map to themselves; the other 68 bytes map, in order, to U+0100...

static int printable_byte(int b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static uint32_t byte_to_cp(int b) {
    if (printable_byte(b)) return (uint32_t)b;
    if (b <= 0x20) return 256u + (uint32_t)b;
    if (b <= 0xA0) return 256u + 33u + (uint32_t)(b - 0x7F);
    return 256u + 67u;  // 0xAD
}

static int cp_to_byte(uint32_t cp) {
    if (cp < 256) return printable_byte((int)cp) ? (int)cp : -1;
    if (cp < 256 + 33) return (int)(cp - 256);
    if (cp < 256 + 67) return (int)(0x7F + cp - 256 - 33);
    if (cp == 256 + 67) return 0xAD;
    return -1;
}

int32_t vocab_bpe_decode_text(const char *text, int32_t len, char *buf, int32_t cap, int32_t *need) {
    int32_t n = 0;
    for (int32_t i = 0; i < len;) {
        int k;
        uint32_t cp = unicode_decode(text + i, (size_t)(len - i), &k);
        int b = cp == UNICODE_INVALID ? -1 : cp_to_byte(cp);
        if (b >= 0) {
            if (n < cap) buf[n] = (char)b;
            n++;
        } else {  // not a GPT-2 character: keep the bytes as they are
            for (int j = 0; j < k; j++, n++)
                if (n < cap) buf[n] = text[i + j];
        }
        i += k;
    }
    *need = n;
    return n < cap ? n : cap;
}

// ---- merges ----

static uint64_t merge_key(pykv_token l, pykv_token r) { return (((uint64_t)(uint32_t)l << 32) | (uint32_t)r) + 1; }

static uint32_t merge_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (uint32_t)k;
}

static const struct vocab_merge_slot *merge_find(const struct vocab_merge_map *m, pykv_token l, pykv_token r) {
    if (!m->slots) return NULL;
    uint64_t key = merge_key(l, r);
    for (uint32_t i = merge_hash(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key) return &m->slots[i];
        if (m->slots[i].key == 0) return NULL;
    }
}

static pykv_status load_merges(struct vocab *v, const struct gguf_file *f) {
    const struct gguf_kv *kv = NULL;
    PYKV_TRY(gguf_get_arr(f, "tokenizer.ggml.merges", GGUF_TYPE_STRING, 0, &kv));
    if (!kv || kv->arr_n == 0) return PYKV_OK;
    if (kv->arr_n > INT32_MAX / 4) return pykv_error(PYKV_ERR_FORMAT, "tokenizer.ggml.merges: too many merges");
    uint32_t cap = 16;
    while (cap < kv->arr_n * 2) cap <<= 1;
    v->merges.mask = cap - 1;
    v->merges.slots = calloc(cap, sizeof(*v->merges.slots));
    char *cat = malloc(1024);
    size_t cat_cap = 1024;
    if (!v->merges.slots || !cat) {
        free(cat);
        return pykv_error(PYKV_ERR_NOMEM, "vocab: out of memory for %llu merges", (unsigned long long)kv->arr_n);
    }
    int32_t skipped = 0;
    for (uint64_t r = 0; r < kv->arr_n; r++) {
        const char *s = kv->arr_strs[r].ptr;
        size_t len = kv->arr_strs[r].len, sp = 1;
        while (sp < len && s[sp] != ' ') sp++;
        if (len < 3 || sp >= len - 1) { skipped++; continue; }
        pykv_token a = vocab_text_to_token(v, s, (int32_t)sp);
        pykv_token b = vocab_text_to_token(v, s + sp + 1, (int32_t)(len - sp - 1));
        if (len - 1 > cat_cap) {
            char *c = realloc(cat, len);
            if (!c) { free(cat); return pykv_error(PYKV_ERR_NOMEM, "vocab: out of memory"); }
            cat = c;
            cat_cap = len;
        }
        memcpy(cat, s, sp);
        memcpy(cat + sp, s + sp + 1, len - sp - 1);
        pykv_token ab = vocab_text_to_token(v, cat, (int32_t)(len - 1));
        if (a < 0 || b < 0 || ab < 0) { skipped++; continue; }
        uint64_t key = merge_key(a, b);
        for (uint32_t i = merge_hash(key) & v->merges.mask;; i = (i + 1) & v->merges.mask) {
            struct vocab_merge_slot *slot = &v->merges.slots[i];
            if (slot->key == key) break;  // a repeated pair keeps its first (best) rank
            if (slot->key == 0) {
                *slot = (struct vocab_merge_slot){key, (int32_t)r, ab};
                break;
            }
        }
    }
    free(cat);
    (void)skipped;  // merges naming tokens the vocabulary lacks can never apply
    return PYKV_OK;
}

// ---- init ----

struct pre_name {
    const char *name;
    int         pre;
};

static const struct pre_name pre_names[] = {
    {"default", VOCAB_PRE_DEFAULT},
    {"gpt2", VOCAB_PRE_GPT2}, {"gpt-2", VOCAB_PRE_GPT2}, {"phi-2", VOCAB_PRE_GPT2},
    {"mpt", VOCAB_PRE_GPT2}, {"olmo", VOCAB_PRE_GPT2}, {"jais", VOCAB_PRE_GPT2},
    {"jina-es", VOCAB_PRE_GPT2}, {"jina-de", VOCAB_PRE_GPT2}, {"jina-v1-en", VOCAB_PRE_GPT2},
    {"llama3", VOCAB_PRE_LLAMA3}, {"llama-v3", VOCAB_PRE_LLAMA3}, {"llama-bpe", VOCAB_PRE_LLAMA3},
    {"falcon3", VOCAB_PRE_LLAMA3}, {"pixtral", VOCAB_PRE_LLAMA3},
    {"dbrx", VOCAB_PRE_LLAMA3}, {"smaug-bpe", VOCAB_PRE_LLAMA3},
    {"qwen2", VOCAB_PRE_QWEN2}, {"stablelm2", VOCAB_PRE_QWEN2}, {"deepseek-r1-qwen", VOCAB_PRE_QWEN2},
    {"smollm", VOCAB_PRE_SMOLLM}, {"starcoder", VOCAB_PRE_SMOLLM}, {"refact", VOCAB_PRE_SMOLLM},
    {"command-r", VOCAB_PRE_SMOLLM}, {"codeshell", VOCAB_PRE_SMOLLM}, {"exaone", VOCAB_PRE_SMOLLM},
    {"minerva-7b", VOCAB_PRE_SMOLLM},
};

pykv_status vocab_bpe_init(struct vocab *v, const struct gguf_file *f) {
    struct gguf_str pre = {0};
    PYKV_TRY(gguf_get_str(f, "tokenizer.ggml.pre", 0, &pre));
    v->pre = VOCAB_PRE_DEFAULT;
    if (pre.len > 0) {
        int found = 0;
        for (size_t i = 0; i < sizeof(pre_names) / sizeof(pre_names[0]); i++)
            if (gguf_str_eq(pre, pre_names[i].name)) { v->pre = pre_names[i].pre; found = 1; break; }
        if (!found)
            return pykv_error(PYKV_ERR_UNSUPPORTED, "tokenizer.ggml.pre '%.*s': unknown pre-tokenizer "
                              "(pykv knows default, gpt2, llama3/llama-bpe, qwen2, smollm/starcoder and aliases)",
                              (int)(pre.len > 64 ? 64 : pre.len), pre.ptr);
    }
    // Llama 3 tokenizers look a whole pre-token up before merging (HF's ignore_merges).
    v->ignore_merges = v->pre == VOCAB_PRE_LLAMA3;
    for (int b = 0; b < 256; b++) {
        char buf[4];
        int n = unicode_encode(byte_to_cp(b), buf);
        v->byte_token[b] = vocab_text_to_token(v, buf, n);
    }
    return load_merges(v, f);
}

// ---- pre-tokenizers ----

enum { F_L = 1, F_N = 2, F_SPACE = 4, F_P = 8 };

struct pretok {
    const uint32_t *cp;
    const uint8_t  *fl;
};

#define IS_L(i)     (t->fl[i] & F_L)
#define IS_N(i)     (t->fl[i] & F_N)
#define IS_SPACE(i) (t->fl[i] & F_SPACE)
#define IS_OTHER(i) (!(t->fl[i] & (F_L | F_N | F_SPACE)))  // [^\s\p{L}\p{N}]
#define IS_NL(i)    (t->cp[i] == '\r' || t->cp[i] == '\n')

// Each matcher tries its regex at i within [i, e) and returns the end of the match, or -1.

static int32_t ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? (int32_t)(c + 32) : (int32_t)c; }

// 's|'t|'re|'ve|'m|'ll|'d (case-insensitive for the Llama 3 family)
static int32_t match_contraction(const struct pretok *t, int32_t i, int32_t e, int icase) {
    if (t->cp[i] != '\'' || i + 1 >= e) return -1;
    int32_t a = icase ? ascii_lower(t->cp[i + 1]) : (int32_t)t->cp[i + 1];
    int32_t b = i + 2 < e ? (icase ? ascii_lower(t->cp[i + 2]) : (int32_t)t->cp[i + 2]) : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return -1;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
static int32_t match_gpt2(const struct pretok *t, int32_t i, int32_t e) {
    int32_t j = match_contraction(t, i, e, 0);
    if (j >= 0) return j;
    j = (t->cp[i] == ' ' && i + 1 < e && !IS_SPACE(i + 1)) ? i + 1 : i;
    if (IS_L(j)) { while (j < e && IS_L(j)) j++; return j; }
    if (IS_N(j)) { while (j < e && IS_N(j)) j++; return j; }
    if (IS_OTHER(j)) { while (j < e && IS_OTHER(j)) j++; return j; }
    int32_t k = i;
    while (k < e && IS_SPACE(k)) k++;
    if (k == e) return e;
    if (k - i >= 2) return k - 1;
    return -1;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}
// | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
static int32_t match_llama3_n(const struct pretok *t, int32_t i, int32_t e, int32_t max_digits) {
    int32_t j = match_contraction(t, i, e, 1);
    if (j >= 0) return j;
    if (!IS_NL(i) && !IS_L(i) && !IS_N(i) && i + 1 < e && IS_L(i + 1)) {
        j = i + 1;
        while (j < e && IS_L(j)) j++;
        return j;
    }
    if (IS_L(i)) { j = i; while (j < e && IS_L(j)) j++; return j; }
    if (IS_N(i)) { j = i; while (j < e && j - i < max_digits && IS_N(j)) j++; return j; }
    j = (t->cp[i] == ' ' && i + 1 < e && IS_OTHER(i + 1)) ? i + 1 : i;
    if (IS_OTHER(j)) {
        while (j < e && IS_OTHER(j)) j++;
        while (j < e && IS_NL(j)) j++;
        return j;
    }
    int32_t k = i;
    while (k < e && IS_SPACE(k)) k++;
    for (int32_t m = k - 1; m >= i; m--)  // \s*[\r\n]+ ends after the run's last newline
        if (IS_NL(m)) return m + 1;
    if (k == e) return e;
    if (k - i >= 2) return k - 1;
    return k;
}

static int32_t match_llama3(const struct pretok *t, int32_t i, int32_t e) { return match_llama3_n(t, i, e, 3); }
static int32_t match_qwen2(const struct pretok *t, int32_t i, int32_t e) { return match_llama3_n(t, i, e, 1); }

// \p{N}
static int32_t match_digit(const struct pretok *t, int32_t i, int32_t e) { return IS_N(i) ? i + 1 : -1; }

// \p{N}+
static int32_t match_digits(const struct pretok *t, int32_t i, int32_t e) {
    if (!IS_N(i)) return -1;
    while (i < e && IS_N(i)) i++;
    return i;
}

// [0-9][0-9][0-9]
static int32_t match_digit3(const struct pretok *t, int32_t i, int32_t e) {
    if (i + 3 > e) return -1;
    for (int32_t k = i; k < i + 3; k++)
        if (t->cp[k] < '0' || t->cp[k] > '9') return -1;
    return i + 3;
}

// [\p{P}\$\+<=>\^~\|]+
static int is_punct_sym(const struct pretok *t, int32_t i) {
    uint32_t c = t->cp[i];
    return (t->fl[i] & F_P) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' || c == '~' || c == '|';
}
static int32_t match_punct(const struct pretok *t, int32_t i, int32_t e) {
    if (!is_punct_sym(t, i)) return -1;
    while (i < e && is_punct_sym(t, i)) i++;
    return i;
}

typedef int32_t (*matcher)(const struct pretok *t, int32_t i, int32_t e);

struct span {
    int32_t a, b;
};

// Split every span at the matches of m; text between matches stays a span of its own
// (HF's Split with behavior "isolated", llama.cpp's unicode_regex_split).
static int32_t split_pass(const struct pretok *t, matcher m, const struct span *in, int32_t n_in, struct span *out) {
    int32_t n = 0;
    for (int32_t s = 0; s < n_in; s++) {
        int32_t gap = in[s].a, e = in[s].b;
        for (int32_t i = in[s].a; i < e;) {
            int32_t end = m(t, i, e);
            if (end <= i) { i++; continue; }
            if (gap < i) out[n++] = (struct span){gap, i};
            out[n++] = (struct span){i, end};
            i = gap = end;
        }
        if (gap < e) out[n++] = (struct span){gap, e};
    }
    return n;
}

static int pre_matchers(int pre, matcher *ms) {
    switch (pre) {
    case VOCAB_PRE_GPT2:   ms[0] = match_gpt2; return 1;
    case VOCAB_PRE_LLAMA3: ms[0] = match_llama3; return 1;
    case VOCAB_PRE_QWEN2:  ms[0] = match_qwen2; return 1;
    case VOCAB_PRE_SMOLLM: ms[0] = match_digit; ms[1] = match_gpt2; return 2;
    default:
        ms[0] = match_punct; ms[1] = match_gpt2; ms[2] = match_digits; ms[3] = match_digit3;
        return 4;
    }
}

// ---- merging ----

struct bpe_cand {
    int32_t rank, left, right;
    pykv_token lid, rid;
};

struct bpe_work {
    pykv_token      *id;
    int32_t         *prev, *next;
    struct bpe_cand *heap;     // the merge candidates (core/heap.h), by cand_before
    int32_t          n_heap;
    char            *enc;   // a word in GPT-2 characters (ignore_merges lookups)
};

// The merge applied first: the lowest rank, then the leftmost.
static int cand_before(const void *pa, const void *pb) {
    const struct bpe_cand *a = pa, *b = pb;
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void try_pair(const struct vocab *v, struct bpe_work *w, int32_t l, int32_t r) {
    if (l < 0 || r < 0 || w->id[l] < 0 || w->id[r] < 0) return;
    const struct vocab_merge_slot *m = merge_find(&v->merges, w->id[l], w->id[r]);
    if (m) heap_push(w->heap, &w->n_heap, &(struct bpe_cand){m->rank, l, r, w->id[l], w->id[r]},
                     sizeof(struct bpe_cand), cand_before);
}

static pykv_status bpe_word(const struct vocab *v, struct bpe_work *w, const unsigned char *s, int32_t n,
                            struct vocab_tokvec *out) {
    if (v->ignore_merges) {
        int32_t len = 0;
        for (int32_t i = 0; i < n; i++) len += unicode_encode(byte_to_cp(s[i]), w->enc + len);
        pykv_token t = vocab_text_to_token(v, w->enc, len);
        if (t >= 0) return vocab_tokvec_push(out, t);
    }
    for (int32_t i = 0; i < n; i++) {
        w->id[i] = v->byte_token[s[i]];
        w->prev[i] = i - 1;
        w->next[i] = i + 1 < n ? i + 1 : -1;
    }
    w->n_heap = 0;
    for (int32_t i = 0; i + 1 < n; i++) try_pair(v, w, i, i + 1);
    while (w->n_heap > 0) {
        struct bpe_cand c;
        heap_pop(w->heap, &w->n_heap, &c, sizeof(c), cand_before);
        if (w->id[c.left] != c.lid || w->id[c.right] != c.rid || w->next[c.left] != c.right) continue;
        const struct vocab_merge_slot *m = merge_find(&v->merges, c.lid, c.rid);
        w->id[c.left] = m->merged;
        w->id[c.right] = -2;  // dead
        int32_t nx = w->next[c.right];
        w->next[c.left] = nx;
        if (nx >= 0) w->prev[nx] = c.left;
        try_pair(v, w, w->prev[c.left], c.left);
        try_pair(v, w, c.left, nx);
    }
    // A byte the vocabulary cannot spell (some vocabularies lack bytes that valid UTF-8
    // never uses, or rare control characters) is dropped, as HF tokenizers does; unk could
    // be an end-of-generation token such as <|endoftext|>.
    for (int32_t i = 0; i >= 0; i = w->next[i])
        if (w->id[i] >= 0) PYKV_TRY(vocab_tokvec_push(out, w->id[i]));
    return PYKV_OK;
}

pykv_status vocab_bpe_tokenize(const struct vocab *v, const char *text, int32_t len, struct vocab_tokvec *out) {
    size_t n = (size_t)len;
    uint32_t *cp = malloc(sizeof(uint32_t) * n);
    int32_t *off = malloc(sizeof(int32_t) * (n + 1));
    uint8_t *fl = malloc(n);
    struct span *sa = malloc(sizeof(struct span) * n), *sb = malloc(sizeof(struct span) * n);
    struct bpe_work w = {
        .id = malloc(sizeof(pykv_token) * n), .prev = malloc(sizeof(int32_t) * n),
        .next = malloc(sizeof(int32_t) * n), .heap = malloc(sizeof(struct bpe_cand) * 3 * n),
        .enc = malloc(2 * n + 4),
    };
    pykv_status st = PYKV_OK;
    if (!cp || !off || !fl || !sa || !sb || !w.id || !w.prev || !w.next || !w.heap || !w.enc) {
        st = pykv_error(PYKV_ERR_NOMEM, "tokenize: out of memory for %d bytes of text", len);
        goto done;
    }
    // Code points with their byte offsets; an invalid byte is one code point of its own
    // (class S like U+FFFD) and keeps its byte, which BPE spells with its byte token.
    int32_t nc = 0;
    for (int32_t i = 0; i < len;) {
        int k;
        uint32_t c = unicode_decode(text + i, (size_t)(len - i), &k);
        cp[nc] = c;
        off[nc] = i;
        enum unicode_class cls = unicode_class_of(c);
        fl[nc] = (uint8_t)((cls == UCLASS_L ? F_L : 0) | (cls == UCLASS_N ? F_N : 0) |
                           (cls == UCLASS_P ? F_P : 0) | (unicode_is_space(c) ? F_SPACE : 0));
        nc++;
        i += k;
    }
    off[nc] = len;
    struct pretok t = {cp, fl};
    matcher ms[4];
    int n_ms = pre_matchers(v->pre, ms);
    int32_t n_spans = 1;
    sa[0] = (struct span){0, nc};
    for (int k = 0; k < n_ms; k++) {
        n_spans = split_pass(&t, ms[k], sa, n_spans, sb);
        struct span *tmp = sa;
        sa = sb;
        sb = tmp;
    }
    for (int32_t s = 0; s < n_spans && st == PYKV_OK; s++) {
        int32_t a = off[sa[s].a], b = off[sa[s].b];
        st = bpe_word(v, &w, (const unsigned char *)text + a, b - a, out);
    }
done:
    free(cp); free(off); free(fl); free(sa); free(sb);
    free(w.id); free(w.prev); free(w.next); free(w.heap); free(w.enc);
    return st;
}
