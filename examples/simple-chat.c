// simple-chat.c - a minimal chat on pykv.h: each line on stdin is a user message, the model's
// greedy reply goes to stdout, one per line; the end of input ends the chat.
//
// From the repository's root: build libpykv as for simple.c, then this program against it:
//
//   cmake -S . -B build && cmake --build build -j
//   cc examples/simple-chat.c -Inative/include -Lbuild -lpykv -Wl,-rpath,"$PWD/build" -o simple-chat
//   ./simple-chat model.gguf ["SYSTEM PROMPT"]
//
// pykv.h has no chat-template renderer (the Python package renders the GGUF's Jinja template,
// which pykv_model_meta_string(model, "tokenizer.chat_template", ...) returns), so this program
// writes ChatML by hand: the format of SmolLM2, Qwen and the other models whose template is
// ChatML. Another model needs its own turn markers in format_turn.
//
// The conversation stays in the context: each turn evaluates only its new text, after the
// tokens of the earlier turns and replies.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pykv.h"

static int fail(const char *what) {
    fprintf(stderr, "%s: %s\n", what, pykv_last_error());
    return 1;
}

// One line of stdin without its newline, in a buffer the caller frees; NULL at the end of input.
static char *read_line(FILE *in) {
    size_t cap = 256, len = 0;
    char *line = malloc(cap);
    int c;
    while (line != NULL && (c = fgetc(in)) != EOF && c != '\n') {
        if (len + 1 == cap) {
            char *grown = realloc(line, cap *= 2);
            if (grown == NULL) free(line);
            line = grown;
            if (line == NULL) break;
        }
        line[len++] = (char)c;
    }
    if (line == NULL || (c == EOF && len == 0)) {
        free(line);
        return NULL;
    }
    if (len > 0 && line[len - 1] == '\r') len--;
    line[len] = '\0';
    return line;
}

// The ChatML text of a user turn, ending where the assistant's reply begins. The first turn
// opens with the system message; a later one (system == NULL) first closes the previous
// reply, whose end-of-turn token was sampled but not evaluated.
static char *format_turn(const char *system, const char *message) {
    const char *format = system != NULL ? "<|im_start|>system\n%s<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n"
                                          "<|im_start|>assistant\n"
                                        : "<|im_end|>\n%s<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n";
    if (system == NULL) system = "";
    size_t size = strlen(format) + strlen(system) + strlen(message) + 1;
    char *text = malloc(size);
    if (text != NULL) snprintf(text, size, format, system, message);
    return text;
}

// Tokenize text, its special-token markers such as <|im_start|> included, and evaluate it
// after what the context holds. add_special adds BOS as the model asks (the first turn only).
static pykv_status eval_text(pykv_model *model, pykv_context *ctx, const char *text, int add_special) {
    int32_t n = 0;
    pykv_tokenize(model, text, (int32_t)strlen(text), add_special, 1, NULL, 0, &n);   // probe the size
    pykv_token *tokens = malloc(sizeof(pykv_token) * (size_t)(n > 0 ? n : 1));
    if (tokens == NULL) return PYKV_ERR_NOMEM;
    pykv_status status = pykv_tokenize(model, text, (int32_t)strlen(text), add_special, 1, tokens, n, &n);
    if (status == PYKV_OK) status = pykv_decode(ctx, tokens, n);
    free(tokens);
    return status;
}

// Greedy-generate the reply until an end-of-generation token, printing each piece as it comes.
// Each printed token is evaluated, so that the context holds the reply for the next turn.
static pykv_status reply(pykv_model *model, pykv_context *ctx, pykv_sampler *smpl) {
    for (;;) {
        pykv_token next;
        pykv_status status = pykv_sampler_sample(smpl, pykv_get_logits(ctx), pykv_vocab_n_tokens(model), &next);
        if (status != PYKV_OK || pykv_vocab_is_eog(model, next)) return status;
        char piece[256];
        int32_t n = 0;
        if (pykv_token_to_piece(model, next, 0, piece, sizeof(piece), &n) == PYKV_OK) fwrite(piece, 1, (size_t)n, stdout);
        fflush(stdout);
        pykv_sampler_accept(smpl, next);
        status = pykv_decode(ctx, &next, 1);   // a full context is an error here
        if (status != PYKV_OK) return status;
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [SYSTEM_PROMPT]   (then one message a line on stdin)\n", argv[0]);
        return 1;
    }
    const char *system = argc > 2 ? argv[2] : "You are a helpful assistant.";
    pykv_model *model = NULL;
    if (pykv_model_load(argv[1], NULL, &model) != PYKV_OK) return fail("load");

    struct pykv_context_params cparams;
    pykv_context_default_params(&cparams);
    cparams.n_ctx = 2048;
    pykv_context *ctx = NULL;
    if (pykv_context_init(model, &cparams, &ctx) != PYKV_OK) return fail("context");

    struct pykv_sampler_params sparams;
    pykv_sampler_default_params(&sparams);
    sparams.temperature = 0.0f;   // greedy
    pykv_sampler *smpl = NULL;
    if (pykv_sampler_init(&sparams, &smpl) != PYKV_OK) return fail("sampler");

    int status = 0;
    for (int turn = 0; status == 0; turn++) {
        fputs("> ", stderr);   // the prompt for a person typing; replies alone go to stdout
        char *line = read_line(stdin);
        if (line == NULL) break;
        char *text = format_turn(turn == 0 ? system : NULL, line);
        if (text == NULL || eval_text(model, ctx, text, turn == 0) != PYKV_OK) status = fail("prompt");
        else if (reply(model, ctx, smpl) != PYKV_OK) status = fail("reply");
        else printf("\n");
        free(text);
        free(line);
    }
    fputs("\n", stderr);

    pykv_sampler_free(smpl);
    pykv_context_free(ctx);
    pykv_model_free(model);
    return status;
}
