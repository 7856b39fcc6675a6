"""Mask cost per token of the two grammar engines meshd could use (xgrammar, llguidance).

For each tokenizer (the built-in model's, and a GGUF file's: pass its path), compile one JSON
schema with each engine, then walk a valid answer token by token and time the engine's mask
for every position (the work the coordinator adds per generated token under a schema), plus
the one-off costs: tokenizer set-up and schema compile. Usage:

    python scripts/grammar_mask_cost.py [~/.cache/meshd/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import llguidance
import numpy as np
import torch
import xgrammar

from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.model.gguf_tokenizer import tokenizer_from_gguf
from meshd.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "kind": {"enum": ["a", "b", "c"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address", "kind", "score"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace, née Byron",
    "age": 36,
    "tags": ["mathematician", "writer", "analytical engine"],
    "address": {"city": "London", "zip": "W1"},
    "kind": "b",
    "score": 97.25,
}


def _ms(samples: list[float]) -> str:
    return (
        f"per token: mean {statistics.mean(samples) * 1e3:.3f} ms, median "
        f"{statistics.median(samples) * 1e3:.3f} ms, max {max(samples) * 1e3:.3f} ms"
    )


def measure(label: str, tok: Tokenizer, vocab: int) -> None:
    text = json.dumps(ANSWER, separators=(",", ":"), ensure_ascii=False)
    ids = tok.encode(text, add_special_tokens=False)
    print(f"{label}: vocab {vocab}, answer {len(ids)} tokens")
    # xgrammar
    t0 = time.perf_counter()
    hf_vocab = tok.vocabulary()
    encoded = [""] * vocab
    for piece, i in hf_vocab.items():
        if i < vocab:
            encoded[i] = piece
    byte_level = any("Ġ" in p for p in hf_vocab)
    kind = xgrammar.VocabType.BYTE_LEVEL if byte_level else xgrammar.VocabType.BYTE_FALLBACK
    info = xgrammar.TokenizerInfo(encoded, kind, vocab_size=vocab, stop_token_ids=list(tok.eos_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    compile_s = time.perf_counter() - t0
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert matcher.accept_token(t), t
    print(
        f"  xgrammar {xgrammar.__version__ if hasattr(xgrammar, '__version__') else ''}: setup "
        f"{setup:.2f} s, compile {compile_s * 1e3:.1f} ms, mask {_ms(times)}"
    )
    # llguidance
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_json(), n_vocab=vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    lm = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not lm.is_error(), lm.get_error()
    words = (vocab + 31) // 32
    buf = np.zeros(words, dtype=np.int32)
    times = []
    for t in ids:
        s = time.perf_counter()
        lm.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        times.append(time.perf_counter() - s)
        assert lm.consume_token(t), (t, lm.get_error())
    print(
        f"  llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}: "
        f"setup {setup:.2f} s, compile {compile_s * 1e3:.1f} ms, mask {_ms(times)}"
    )


def main() -> None:
    torch.set_num_threads(1)
    builtin = open_tokenizer(builtin_model_dir())
    measure("built-in", builtin, builtin.vocab_size)
    for path in sys.argv[1:]:
        tok = tokenizer_from_gguf(path)
        measure(path.rsplit("/", 1)[-1], tok, tok.vocab_size)


if __name__ == "__main__":
    main()
