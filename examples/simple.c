// simple.c - the smallest complete pykv program: load a model, greedy-generate from a prompt.
//
// From the repository's root: build libpykv, then this program against it (the rpath lets
// the program find libpykv.so where it was built):
//
//   cmake -S . -B build && cmake --build build -j
//   cc examples/simple.c -Inative/include -Lbuild -lpykv -Wl,-rpath,"$PWD/build" -o simple
//   ./simple model.gguf "The capital of France is" 32
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pykv.h"

static int fail(const char *what) {
    fprintf(stderr, "%s: %s\n", what, pykv_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT [N_PREDICT]\n", argv[0]);
        return 1;
    }
    int n_predict = argc > 3 ? atoi(argv[3]) : 32;

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

    // tokenize: probe the size, then allocate
    const char *prompt = argv[2];
    int32_t n_prompt = 0;
    pykv_tokenize(model, prompt, (int32_t)strlen(prompt), 1, 1, NULL, 0, &n_prompt);
    pykv_token *tokens = malloc(sizeof(pykv_token) * (size_t)(n_prompt > 0 ? n_prompt : 1));
    if (pykv_tokenize(model, prompt, (int32_t)strlen(prompt), 1, 1, tokens, n_prompt, &n_prompt) != PYKV_OK)
        return fail("tokenize");

    printf("%s", prompt);
    if (pykv_decode(ctx, tokens, n_prompt) != PYKV_OK) return fail("decode");
    for (int i = 0; i < n_predict; i++) {
        pykv_token next;
        if (pykv_sampler_sample(smpl, pykv_get_logits(ctx), pykv_vocab_n_tokens(model), &next) != PYKV_OK)
            return fail("sample");
        if (pykv_vocab_is_eog(model, next)) break;
        char piece[256];
        int32_t n = 0;
        if (pykv_token_to_piece(model, next, 0, piece, sizeof(piece), &n) == PYKV_OK) fwrite(piece, 1, (size_t)n, stdout);
        fflush(stdout);
        pykv_sampler_accept(smpl, next);
        if (pykv_decode(ctx, &next, 1) != PYKV_OK) return fail("decode");
    }
    printf("\n");

    struct pykv_timings t;
    pykv_get_timings(ctx, &t);
    fprintf(stderr, "prefill: %d tokens, %.1f tok/s | decode: %d tokens, %.1f tok/s\n", t.n_prefill,
            t.n_prefill / (t.t_prefill_ms / 1e3), t.n_decode, t.n_decode / (t.t_decode_ms / 1e3));
    free(tokens);
    pykv_sampler_free(smpl);
    pykv_context_free(ctx);
    pykv_model_free(model);
    return 0;
}
