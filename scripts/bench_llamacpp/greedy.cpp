// Greedy decoding with llama.cpp from given prompt token ids; prints the new token ids.
//
//   meshd-greedy MODEL.gguf N_NEW THREADS ID,ID,...
//
// Built by scripts/bench_llamacpp against the library it built, so that meshd's and
// llama.cpp's greedy tokens can be compared from the same prompt ids (llama-simple takes text
// and stops at end-of-generation tokens; this decodes exactly N_NEW tokens, as meshd's bench
// does). Modelled on examples/simple/simple.cpp of the same llama.cpp.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

static void set_tokens(llama_batch_ext * batch, const llama_token * ids, int32_t n, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, ids[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf N_NEW THREADS ID,ID,...\n", argv[0]);
        return 2;
    }
    const int n_new = std::atoi(argv[2]);
    const int threads = std::atoi(argv[3]);
    std::vector<llama_token> prompt;
    std::stringstream ids(argv[4]);
    for (std::string item; std::getline(ids, item, ',');) {
        prompt.push_back((llama_token) std::atoi(item.c_str()));
    }
    if (prompt.empty() || n_new < 1) {
        fprintf(stderr, "need a prompt and N_NEW >= 1\n");
        return 2;
    }

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        fprintf(stderr, "unable to load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) (prompt.size() + n_new);
    cparams.n_batch = 1;
    cparams.n_ubatch = 1;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "unable to create a context\n");
        return 1;
    }
    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    // The prompt goes in one token per step, as decoding does: on a CPU that lists AMX but
    // whose (virtual) machine faults on its tile instructions, llama.cpp's AMX kernels for
    // q8_0/q4_0 batches of more than one token crash (SIGILL/SIGSEGV in ldtilecfg).
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    for (size_t i = 0; i + 1 < prompt.size(); ++i) {
        set_tokens(batch, &prompt[i], 1, (llama_pos) i);
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) != 0) {
            fprintf(stderr, "decode failed at prompt token %zu\n", i);
            return 1;
        }
    }
    set_tokens(batch, &prompt.back(), 1, (llama_pos) prompt.size() - 1);
    llama_pos pos = (llama_pos) prompt.size();
    for (int i = 0; i < n_new; ++i) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) != 0) {
            fprintf(stderr, "decode failed at token %d\n", i);
            return 1;
        }
        llama_token next = llama_sampler_sample(smpl, ctx, -1);
        printf(i == 0 ? "%d" : ",%d", next);
        set_tokens(batch, &next, 1, pos);
        pos += 1;
    }
    printf("\n");

    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
