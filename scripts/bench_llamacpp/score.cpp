// llama.cpp's side of `meshd bench perplexity --token-ids`: score given token ids.
//
//   meshd-score MODEL.gguf IDS.json THREADS [--no-extra-bufts] [--flash-attn on|off] [--kv-f32]
//
// IDS.json holds a JSON list of token ids (or an object with one under "tokens", such as
// `meshd bench perplexity --json`'s report). Every id goes through llama.cpp in one batch per
// context window (the model's training context), logits kept for every position, and this
// prints the JSON `meshd bench perplexity --json` prints: tokens, nll (the mean natural-log
// negative likelihood of ids 1..n-1), ppl = exp(nll), top1 (the argmax at positions 0..n-2)
// and n. A window's last position still predicts the next window's first id, as in meshd.
// Log-softmax in double precision over the fp32 logits llama.cpp returns.
//
// `--no-extra-bufts` keeps weights in plain CPU buffers (no repacking for AMX or other
// extra buffer types): on a (virtual) machine that lists AMX but faults on its tile
// instructions, llama.cpp's AMX kernels for batches of more than one token crash.
// `--flash-attn on|off` and `--kv-f32` (an fp32 KV cache instead of llama.cpp's default fp16)
// score the ids under another of llama.cpp's own settings: how far llama.cpp moves from itself
// is the floor under which no other engine's agreement with it can be read.
//
// Built by scripts/bench_llamacpp against the library it built (like greedy.cpp).
#include "llama.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static bool read_ids(const char * path, std::vector<llama_token> & ids) {
    std::ifstream f(path);
    if (!f) {
        return false;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    std::string text = ss.str();
    size_t from = 0;
    const size_t key = text.find("\"tokens\"");
    if (key != std::string::npos) {
        from = key;
    }
    const size_t open = text.find('[', from);
    const size_t close = open == std::string::npos ? open : text.find(']', open);
    if (open == std::string::npos || close == std::string::npos) {
        return false;
    }
    for (size_t i = open + 1; i < close;) {
        if (std::isdigit((unsigned char) text[i])) {
            char * end = nullptr;
            ids.push_back((llama_token) std::strtol(text.c_str() + i, &end, 10));
            i = (size_t) (end - text.c_str());
        } else if (text[i] == ',' || std::isspace((unsigned char) text[i])) {
            ++i;
        } else {
            return false;
        }
    }
    return true;
}

int main(int argc, char ** argv) {
    bool extra_bufts = true, kv_f32 = false;
    int flash_attn = -1;  // llama.cpp's default (auto)
    bool usage = argc < 4;
    for (int i = 4; i < argc && !usage; i++) {
        if (std::strcmp(argv[i], "--no-extra-bufts") == 0) {
            extra_bufts = false;
        } else if (std::strcmp(argv[i], "--kv-f32") == 0) {
            kv_f32 = true;
        } else if (std::strcmp(argv[i], "--flash-attn") == 0 && i + 1 < argc) {
            flash_attn = std::strcmp(argv[++i], "on") == 0 ? 1 : 0;
        } else {
            usage = true;
        }
    }
    if (usage) {
        fprintf(stderr,
                "usage: %s MODEL.gguf IDS.json THREADS [--no-extra-bufts] [--flash-attn on|off] "
                "[--kv-f32]\n",
                argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[3]);
    std::vector<llama_token> ids;
    if (!read_ids(argv[2], ids) || ids.size() < 2) {
        fprintf(stderr, "%s: expected a JSON list of at least 2 token ids\n", argv[2]);
        return 2;
    }

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    if (!extra_bufts) {
        mparams.use_extra_bufts = false;
    }
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        fprintf(stderr, "unable to load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token t : ids) {
        if (t < 0 || t >= n_vocab) {
            fprintf(stderr, "token id %d outside the vocabulary (%d)\n", t, n_vocab);
            return 2;
        }
    }
    const int n = (int) ids.size();
    const int train_ctx = llama_model_n_ctx_train(model);
    const int window = train_ctx > 0 && train_ctx < n ? train_ctx : n;

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) window;
    cparams.n_batch = (uint32_t) window;
    cparams.n_ubatch = (uint32_t) window;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    if (flash_attn >= 0) {
        cparams.flash_attn_type =
            flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    }
    if (kv_f32) {
        cparams.type_k = GGML_TYPE_F32;
        cparams.type_v = GGML_TYPE_F32;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "unable to create a context\n");
        return 1;
    }

    std::vector<double> nll;
    std::vector<int> top1;
    llama_batch batch = llama_batch_init(window, 0, 1);
    for (int start = 0; start < n; start += window) {
        const int len = std::min(window, n - start);
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = len;
        for (int i = 0; i < len; ++i) {
            batch.token[i] = ids[start + i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "decode failed on the window at %d\n", start);
            return 1;
        }
        for (int i = 0; i < len && start + i + 1 < n; ++i) {
            const float * row = llama_get_logits_ith(ctx, i);
            int best = 0;
            double max = row[0];
            for (int v = 1; v < n_vocab; ++v) {
                if (row[v] > max) {
                    max = row[v];
                    best = v;
                }
            }
            double sum = 0.0;
            for (int v = 0; v < n_vocab; ++v) {
                sum += std::exp((double) row[v] - max);
            }
            nll.push_back(max + std::log(sum) - (double) row[ids[start + i + 1]]);
            top1.push_back(best);
        }
    }
    double total = 0.0;
    for (double x : nll) {
        total += x;
    }
    const double mean = total / (double) nll.size();
    printf("{\"model\": \"%s\", \"quantization\": \"llama.cpp\", \"tokens\": [", argv[1]);
    for (int i = 0; i < n; ++i) {
        printf(i ? ", %d" : "%d", ids[i]);
    }
    printf("], \"nll\": %.17g, \"ppl\": %.17g, \"top1\": [", mean, std::exp(mean));
    for (size_t i = 0; i < top1.size(); ++i) {
        printf(i ? ", %d" : "%d", top1[i]);
    }
    printf("], \"n\": %d, \"context\": %d, \"threads\": %d, \"extra_bufts\": %s}\n", n,
           train_ctx, threads, argc == 5 ? "false" : "true");

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
