// test_grammar.c - GBNF parsing errors and the matcher on a small made-up vocabulary: allowed
// tokens, acceptance, characters split across tokens, completion, and refusals that change
// nothing. (Python checks the matcher against a regular-expression reference on real vocabularies.)
#include "check.h"
#include "grammar.h"
#include "pykv.h"

#include <stdint.h>
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

int main(void) {
    test_parse_errors();
    test_repetition();
    test_classes_and_groups();
    test_split_character();
    test_sampler();
    return check_report("test_grammar");
}
