// test_grammar.c - GBNF parsing errors and the matcher on a small made-up vocabulary: allowed
// tokens, acceptance, characters split across tokens, completion, and refusals that change
// nothing. (Python checks the matcher against a regular-expression reference on real vocabularies.)
#include "check.h"
#include "sample/grammar.h"
#include "pykv.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Token texts; the last one is end-of-generation (no text).
static const char *VOCAB[] = { "a", "b", "ab", "ba", "\"", "{", "}", "\xC3\xA9", "\xC3", "\xA9", "1", "12", " ", "" };
#define N_VOCAB ((int32_t)(sizeof(VOCAB) / sizeof(VOCAB[0])))
enum { A, B, AB, BA, QUOTE, LBRACE, RBRACE, E_ACUTE, E_LEAD, E_TAIL, ONE, TWELVE, SPACE, EOG };

static pykv_grammar *make(const char *text) {
    char pieces[256];
    int32_t offsets[N_VOCAB + 1], at = 0;
    uint8_t eog[N_VOCAB];
    for (int32_t t = 0; t < N_VOCAB; t++) {
        offsets[t] = at;
        memcpy(pieces + at, VOCAB[t], strlen(VOCAB[t]));
        at += (int32_t)strlen(VOCAB[t]);
        eog[t] = t == EOG;
    }
    offsets[N_VOCAB] = at;
    pykv_grammar *g = NULL;
    pykv_status st = grammar_init_tokens(text, NULL, N_VOCAB, pieces, offsets, eog, &g);
    if (st != PYKV_OK) fprintf(stderr, "grammar failed: %s\n", pykv_last_error());
    CHECK(st == PYKV_OK);
    return g;
}

// The allowed set as a bit mask over VOCAB.
static uint32_t allowed_mask(pykv_grammar *g) {
    uint8_t allowed[N_VOCAB];
    CHECK(pykv_grammar_allowed(g, allowed, N_VOCAB) == PYKV_OK);
    uint32_t m = 0;
    for (int32_t t = 0; t < N_VOCAB; t++) m |= (uint32_t)allowed[t] << t;
    return m;
}

#define BIT(t) (1u << (t))

static void expect_error(const char *text, const char *needle) {
    pykv_grammar *g = NULL;
    pykv_status st = pykv_grammar_init(NULL, text, NULL, &g);
    CHECK(st == PYKV_ERR_INVALID_ARG && g == NULL);
    if (!strstr(pykv_last_error(), needle)) {
        fprintf(stderr, "for %s: expected '%s' in '%s'\n", text, needle, pykv_last_error());
        CHECK(0);
    }
}

static void test_parse_errors(void) {
    expect_error("root ::= x", "line 1, column 10: rule 'x' is used but not defined");
    expect_error("start ::= \"a\"", "no rule named 'root'");
    expect_error("root ::= \"abc", "line 1, column 10: unterminated string literal");
    expect_error("root ::= [a-", "unterminated character class");
    expect_error("root ::= \"\\q\"", "unknown escape");
    expect_error("root ::= [z-a]", "end before its start");
    expect_error("root ::= root \"a\" | \"b\"", "rule 'root' is left-recursive");
    expect_error("root ::= x \"a\"\nx ::= \"b\"? root", "left-recursive");
    expect_error("root ::= \"a\"{3,1}", "n < m");
    expect_error("root ::= \"a\"{5000}", "above 4096");
    expect_error("root ::= * \"a\"", "nothing before it");
    expect_error("root ::= (\"a\" | \"b\"", "unclosed '('");
    expect_error("root ::= \"a\")", "')' without '('");
    expect_error("root ::= \"a\"\nroot ::= \"b\"", "line 2, column 1: rule defined twice");
    expect_error("root = \"a\"", "expected '::='");
    expect_error("root ::= \"\xC3\"", "invalid UTF-8");
    expect_error("root ::= \"\xC0\xAF\"", "line 1, column 11: invalid UTF-8");   // overlong '/'
    expect_error("root ::= [\xED\xA0\x80]", "invalid UTF-8");                  // a surrogate
    expect_error("", "no rules");

    pykv_grammar *g = NULL;   // a grammar without a model parses but cannot match tokens
    CHECK(pykv_grammar_init(NULL, "root ::= \"a\" | # comment\n  [b-c]* # more\n", NULL, &g) == PYKV_OK);
    uint8_t allowed[4];
    CHECK(pykv_grammar_allowed(g, allowed, 4) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "without a model") != NULL);
    CHECK(pykv_grammar_accept(g, 0) == PYKV_ERR_INVALID_ARG);
    pykv_grammar_free(g);
    // an empty last alternative written as a trailing `|`, then the next rule on its own line
    CHECK(pykv_grammar_init(NULL, "root ::= \"a\" x |\nx ::= \"b\"\n", NULL, &g) == PYKV_OK);
    pykv_grammar_free(g);
    expect_error("root ::= \"a\" x ::= \"b\"", "line 1, column 14: unexpected character");
    CHECK(pykv_grammar_init(NULL, NULL, NULL, &g) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_grammar_init(NULL, "root ::= \"a\"", NULL, NULL) == PYKV_ERR_INVALID_ARG);
}

static void test_repetition(void) {
    pykv_grammar *g = make("root ::= \"a\"+ \"b\"?");
    CHECK(allowed_mask(g) == (BIT(A) | BIT(AB)));
    CHECK(!pykv_grammar_is_complete(g));
    CHECK(pykv_grammar_accept(g, A) == PYKV_OK);
    CHECK(allowed_mask(g) == (BIT(A) | BIT(B) | BIT(AB) | BIT(EOG)));
    CHECK(pykv_grammar_is_complete(g));
    CHECK(pykv_grammar_accept(g, B) == PYKV_OK);
    CHECK(allowed_mask(g) == BIT(EOG));
    CHECK(pykv_grammar_accept(g, EOG) == PYKV_OK);
    // a refused token changes nothing
    CHECK(pykv_grammar_accept(g, A) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "does not continue the grammar") != NULL);
    CHECK(allowed_mask(g) == BIT(EOG));
    CHECK(pykv_grammar_reset(g) == PYKV_OK);
    CHECK(allowed_mask(g) == (BIT(A) | BIT(AB)));
    CHECK(pykv_grammar_accept(g, EOG) == PYKV_ERR_INVALID_ARG);   // not complete yet
    CHECK(pykv_grammar_accept(g, N_VOCAB) == PYKV_ERR_INVALID_ARG);
    pykv_grammar_free(g);

    g = make("root ::= [0-9]{2,3}");
    CHECK(allowed_mask(g) == (BIT(ONE) | BIT(TWELVE)));
    CHECK(pykv_grammar_accept(g, TWELVE) == PYKV_OK);
    CHECK(allowed_mask(g) == (BIT(ONE) | BIT(EOG)));
    CHECK(pykv_grammar_accept(g, ONE) == PYKV_OK);
    CHECK(allowed_mask(g) == BIT(EOG));
    pykv_grammar_free(g);
}

static void test_classes_and_groups(void) {
    // a quoted string of anything but quotes and braces, then a brace group
    pykv_grammar *g = make("root ::= \"\\\"\" [^\"{}]* \"\\\"\" ws obj\nobj ::= \"{\" (\"a\" | \"b\")* \"}\"\nws ::= [ \\t]*");
    CHECK(allowed_mask(g) == BIT(QUOTE));
    CHECK(pykv_grammar_accept(g, QUOTE) == PYKV_OK);
    uint32_t inside = BIT(A) | BIT(B) | BIT(AB) | BIT(BA) | BIT(E_ACUTE) | BIT(E_LEAD) | BIT(ONE) | BIT(TWELVE) |
                      BIT(SPACE) | BIT(QUOTE);
    CHECK(allowed_mask(g) == inside);
    CHECK(pykv_grammar_accept(g, QUOTE) == PYKV_OK);
    CHECK(allowed_mask(g) == (BIT(SPACE) | BIT(LBRACE)));
    CHECK(pykv_grammar_accept(g, LBRACE) == PYKV_OK);
    CHECK(allowed_mask(g) == (BIT(A) | BIT(B) | BIT(AB) | BIT(BA) | BIT(RBRACE)));
    CHECK(pykv_grammar_accept(g, BA) == PYKV_OK);
    CHECK(pykv_grammar_accept(g, RBRACE) == PYKV_OK);
    CHECK(pykv_grammar_is_complete(g));
    pykv_grammar_free(g);
}

static void test_split_character(void) {
    // é arrives whole, or as its two bytes in two tokens
    pykv_grammar *g = make("root ::= \"\\u00e9\" \"a\"");
    CHECK(allowed_mask(g) == (BIT(E_ACUTE) | BIT(E_LEAD)));
    CHECK(pykv_grammar_accept(g, E_LEAD) == PYKV_OK);
    CHECK(!pykv_grammar_is_complete(g));
    CHECK(allowed_mask(g) == BIT(E_TAIL));
    CHECK(pykv_grammar_accept(g, A) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_grammar_accept(g, E_TAIL) == PYKV_OK);
    CHECK(allowed_mask(g) == BIT(A));
    pykv_grammar_free(g);

    g = make("root ::= [a-z]");   // é's first byte cannot start a character in a-z
    CHECK(allowed_mask(g) == (BIT(A) | BIT(B)));
    pykv_grammar_free(g);
    g = make("root ::= .");
    CHECK(allowed_mask(g) == (BIT(A) | BIT(B) | BIT(QUOTE) | BIT(LBRACE) | BIT(RBRACE) | BIT(E_ACUTE) | BIT(E_LEAD) |
                              BIT(ONE) | BIT(SPACE)));
    pykv_grammar_free(g);
}

static void test_sampler(void) {
    pykv_grammar *g = make("root ::= \"b\" | \"12\"");
    struct pykv_sampler_params p;
    pykv_sampler_default_params(&p);
    p.temperature = 0;
    pykv_sampler *s = NULL;
    CHECK(pykv_sampler_init(&p, &s) == PYKV_OK);
    float logits[N_VOCAB];
    for (int32_t t = 0; t < N_VOCAB; t++) logits[t] = (float)t;   // EOG best, then SPACE, ...
    pykv_token tok = -1;
    CHECK(pykv_sampler_set_grammar(s, g) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, N_VOCAB, &tok) == PYKV_OK && tok == TWELVE);
    CHECK(pykv_grammar_accept(g, tok) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, N_VOCAB, &tok) == PYKV_OK && tok == EOG);
    CHECK(pykv_sampler_sample(s, logits, N_VOCAB - 1, &tok) == PYKV_ERR_INVALID_ARG);   // wrong vocabulary
    CHECK(strstr(pykv_last_error(), "the grammar's vocabulary has 14") != NULL);
    CHECK(pykv_sampler_sample(s, logits, N_VOCAB + 1, &tok) == PYKV_ERR_INVALID_ARG);
    logits[EOG] = -INFINITY;
    CHECK(pykv_sampler_sample(s, logits, N_VOCAB, &tok) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "the grammar allows") != NULL);
    CHECK(pykv_sampler_set_grammar(s, NULL) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, N_VOCAB, &tok) == PYKV_OK && tok == SPACE);
    pykv_sampler_free(s);
    pykv_grammar_free(g);
}

// ---- deep and large grammars ----

// `root ::= ((( ... "a" ... )))` with depth groups; the caller frees it.
static char *nested(int depth) {
    char *t = malloc((size_t)depth * 2 + 32);
    int n = sprintf(t, "root ::= ");
    memset(t + n, '(', (size_t)depth);
    n += depth;
    n += sprintf(t + n, "\"a\"");
    memset(t + n, ')', (size_t)depth);
    t[n + depth] = '\0';
    return t;
}

// A chain of named rules, root ::= r0, r0 ::= r1, ..., r{n-1} ::= "a" ("a" twice: `| alts`
// alternatives each, all the same, so the chain's expansion visits alts^n paths).
static char *chain(int n, int alts) {
    char *t = malloc((size_t)n * (size_t)alts * 32 + 64), *p = t;
    p += sprintf(p, "root ::= r0\n");
    for (int i = 0; i < n; i++) {
        p += sprintf(p, "r%d ::= ", i);
        for (int a = 0; a < alts; a++) {
            if (i + 1 < n) p += sprintf(p, a ? " | r%d" : "r%d", i + 1);
            else p += sprintf(p, a ? " | \"a\"" : "\"a\"");
        }
        p += sprintf(p, "\n");
    }
    return t;
}

static void test_nesting_limit(void) {
    char *t = nested(256);   // the documented limit parses
    pykv_grammar *g = make(t);
    CHECK(pykv_grammar_accept(g, A) == PYKV_OK && pykv_grammar_is_complete(g));
    pykv_grammar_free(g);
    free(t);
    t = nested(257);
    expect_error(t, "line 1, column 266: groups nested more than 256 deep");
    free(t);
    t = nested(100000);   // deep enough to overflow any stack if nothing stopped it
    expect_error(t, "groups nested more than 256 deep");
    free(t);
    // 256 deep inside each of many sibling groups is fine: the bound is on depth, not count
    char *wide = malloc(100 * 520 + 32), *p = wide;
    p += sprintf(p, "root ::= ");
    for (int i = 0; i < 100; i++) {
        memset(p, '(', 256); p += 256;
        p += sprintf(p, "\"a\"");
        memset(p, ')', 256); p += 256;
        *p++ = ' ';
    }
    *p = '\0';
    g = NULL;
    CHECK(pykv_grammar_init(NULL, wide, NULL, &g) == PYKV_OK);
    pykv_grammar_free(g);
    free(wide);
}

// Parse and follow the deepest grammars the bounds allow on a small stack: groups 256 deep, and
// a chain of 100000 named rules, which the matcher expands 100000 rules deep at its first step.
static void *deep_on_small_stack(void *arg) {
    int *ok = arg;
    char *t = nested(256);
    pykv_grammar *g = make(t);
    *ok = pykv_grammar_accept(g, A) == PYKV_OK && pykv_grammar_is_complete(g);
    pykv_grammar_free(g);
    free(t);
    t = chain(100000, 1);
    g = make(t);
    uint8_t allowed[N_VOCAB];
    *ok = *ok && pykv_grammar_allowed(g, allowed, N_VOCAB) == PYKV_OK && allowed[A] && !allowed[B];
    *ok = *ok && pykv_grammar_accept(g, A) == PYKV_OK && pykv_grammar_is_complete(g);
    pykv_grammar_free(g);
    free(t);
    t = nested(100000);
    g = NULL;
    *ok = *ok && pykv_grammar_init(NULL, t, NULL, &g) == PYKV_ERR_INVALID_ARG;
    free(t);
    return NULL;
}

static void test_small_stack(void) {
    pthread_attr_t attr;
    pthread_t th;
    int ok = 0;
    CHECK(pthread_attr_init(&attr) == 0);
    CHECK(pthread_attr_setstacksize(&attr, 512 * 1024) == 0);
    CHECK(pthread_create(&th, &attr, deep_on_small_stack, &ok) == 0);
    CHECK(pthread_join(th, NULL) == 0);
    CHECK(ok);
    pthread_attr_destroy(&attr);
}

// A grammar reaching the same stacks along 2^30 paths is refused at once, not expanded for hours.
static void test_ambiguous_expansion(void) {
    char *t = chain(30, 2);
    expect_error(t, "rule alternatives to expand at one point");
    free(t);
    t = chain(8, 2);   // 256 paths: fine
    pykv_grammar *g = make(t);
    CHECK(allowed_mask(g) == BIT(A));
    pykv_grammar_free(g);
    free(t);
}

// The parser's work (grammar_rules.parse_work: name probes, the nullable and left-recursion
// steps) per byte of text stays under a constant as grammars grow 16-fold, in each shape that
// used to cost more: many rules, many alternatives, long chains, nested optional groups.
static char *many_alternatives(int n) {
    char *t = malloc((size_t)n * 4 + 64), *p = t;
    p += sprintf(p, "root ::= x");
    for (int i = 1; i < n; i++) p += sprintf(p, " | x");
    sprintf(p, "\nx ::= \"a\"\n");
    return t;
}

static char *many_names(int n) {   // n rules, each used once from root, defined after it
    char *t = malloc((size_t)n * 32 + 64), *p = t;
    p += sprintf(p, "root ::= ");
    for (int i = 0; i < n; i++) p += sprintf(p, "rule%d ", i);
    p += sprintf(p, "\n");
    for (int i = 0; i < n; i++) p += sprintf(p, "rule%d ::= \"a\"?\n", i);
    return t;
}

static char *nested_optional(int n) {   // groups of (((("a")?)?)?) 200 deep, n/200 of them in a row
    char *t = malloc((size_t)n * 4 + 64), *p = t;
    p += sprintf(p, "root ::= ");
    for (int k = 0; k < n / 200; k++) {
        memset(p, '(', 200); p += 200;
        p += sprintf(p, "\"a\"");
        for (int i = 0; i < 200; i++) p += sprintf(p, ")?");
        *p++ = ' ';
    }
    *p = '\0';
    return t;
}

static char *chain_of_one(int n) { return chain(n, 1); }

static void test_linear_work(void) {
    char *(*shapes[])(int) = { many_alternatives, many_names, nested_optional, chain_of_one };
    const char *names[] = { "many alternatives", "many names", "nested optional groups", "a chain of rules" };
    for (int s = 0; s < 4; s++) {
        for (int n = 2000; n <= 32000; n *= 4) {
            char *t = shapes[s](n);
            struct grammar_rules r;
            pykv_status st = grammar_parse(t, "root", &r);
            CHECK(st == PYKV_OK);
            double per_byte = (double)r.parse_work / (double)strlen(t);
            if (!(per_byte < 8.0)) {   // 4 in nested optional groups (three rules per 3 bytes `)?`), under 2 elsewhere
                fprintf(stderr, "%s, n = %d: %lld steps for %zu bytes\n", names[s], n, (long long)r.parse_work,
                        strlen(t));
                CHECK(0);
            }
            grammar_rules_free(&r);
            free(t);
        }
    }
}

int main(void) {
    test_parse_errors();
    test_nesting_limit();
    test_small_stack();
    test_ambiguous_expansion();
    test_linear_work();
    test_repetition();
    test_classes_and_groups();
    test_split_character();
    test_sampler();
    return check_report("test_grammar");
}
