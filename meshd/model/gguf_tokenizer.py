"""A `Tokenizer` built from a GGUF file's `tokenizer.ggml.*` metadata.

Two tokenizer models are rebuilt as `tokenizers.Tokenizer` objects, so `meshd.model.tokenizer`
works unchanged on them:

- `gpt2`: byte-level BPE (tokens + merges), with the pre-tokenizer `tokenizer.ggml.pre` names
  (`gpt-2`, Llama 3's `llama-bpe`, `qwen2`; the same split regexes as their tokenizer.json);
- `llama`: SentencePiece BPE (tokens + scores + token types), with byte fallback (`<0xXX>`)
  and the `▁` space convention. Merges come from the scores the way transformers converts a
  SentencePiece model (every split of a piece into two pieces, ranked by the piece's score),
  which is also the order llama.cpp's SPM tokenizer merges in.

Control tokens become special added tokens, user-defined ones plain added tokens; bos/eos/unk/
pad ids, `add_bos_token`/`add_eos_token` and `tokenizer.chat_template` carry over. Stop ids are
the eos/eot/eom ids plus llama.cpp's end-of-generation token texts.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers, processors

from meshd.model.errors import MissingFile, ModelError, TokenizerError
from meshd.model.gguf_file import GGUFMetadata, read_shards
from meshd.model.gguf_model import stop_ids
from meshd.model.tokenizer import Tokenizer

# gguf.TokenType values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, or None for ByteLevel's own GPT-2 regex; ignore_merges).
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "gpt-2": (None, False),
    "llama-bpe": (_LLAMA3_REGEX, True),
    "llama3": (_LLAMA3_REGEX, True),
    "llama-v3": (_LLAMA3_REGEX, True),
    "qwen2": (_QWEN2_REGEX, False),
    "deepseek-r1-qwen": (_QWEN2_REGEX, False),
    # SmolLM's tokenizer.json: each digit its own piece, then GPT-2's byte-level split
    # (llama.cpp's SMOLLM pre-type: `\p{N}`, then GPT-2's regex).
    "smollm": (None, False),
}
_DIGITS_FIRST = frozenset({"smollm"})
_SPACE = "\u2581"  # SentencePiece's visible space


def tokenizer_from_gguf(path: str | pathlib.Path) -> Tokenizer:
    """The tokenizer, special tokens, stop ids and chat template stored in a GGUF file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise MissingFile(f"{path}: GGUF file not found")
    try:
        # A split model's metadata is in its first shard.
        first, reader = read_shards(path)[0]
        meta = GGUFMetadata(reader, str(first))
        return build_tokenizer(meta)
    except TokenizerError:
        raise
    except ModelError as exc:
        raise TokenizerError(str(exc)) from None


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """Rebuild the tokenizer described by `meta` (see the module docstring)."""
    source = meta.source
    model = meta.string("tokenizer.ggml.model")
    tokens = meta.value("tokenizer.ggml.tokens")
    if model is None or not isinstance(tokens, list) or not tokens:
        raise TokenizerError(f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.*)")
    types = meta.value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    ids = {key: meta.optional_id(f"tokenizer.ggml.{key}_token_id") for key in _SPECIAL_IDS}
    for key, token_id in ids.items():
        if token_id is not None and token_id >= len(tokens):
            raise TokenizerError(f"{source}: {key} token id {token_id} is beyond the vocabulary")
    if model == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
        add_bos_default = meta.string("tokenizer.ggml.pre", "default") in ("llama-bpe", "llama3")
    elif model == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types, ids["unknown"])
        add_bos_default = True
    else:
        raise TokenizerError(
            f"{source}: tokenizer model {model!r} is not supported (supported: gpt2, llama)"
        )
    added = [
        tokenizers.AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
        for i in np.flatnonzero(np.isin(np.asarray(types), (CONTROL, USER_DEFINED))).tolist()
    ]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])
    add_bos = bool(meta.value("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.value("tokenizer.ggml.add_eos_token", False))
    _post_processor(backend, tokens, ids, add_bos, add_eos, source)
    special = {
        f"{name}_token": tokens[token_id]
        for key, name in (("bos", "bos"), ("eos", "eos"), ("unknown", "unk"), ("padding", "pad"))
        if (token_id := ids[key]) is not None
    }
    template = meta.value("tokenizer.chat_template")
    return Tokenizer(
        backend,
        special_tokens=special,
        eos_ids=stop_ids(meta),
        chat_template=template if isinstance(template, str) else None,
    )


_SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "padding")


def _byte_level_bpe(meta: GGUFMetadata, tokens: list[str]) -> tokenizers.Tokenizer:
    source = meta.source
    pre = meta.string("tokenizer.ggml.pre", "default") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerError(
            f"{source}: BPE pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    regex, ignore_merges = _PRE_TOKENIZERS[pre]
    raw_merges = meta.value("tokenizer.ggml.merges") or []
    split = [str(merge).partition(" ") for merge in raw_merges]
    for (_, sep, _), merge in zip(split, raw_merges, strict=True):
        if not sep:
            raise TokenizerError(f"{source}: BPE merge {merge!r} is not two tokens")
    merges = [(left, right) for left, _, right in split]
    vocab = _vocab(tokens)
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
    )
    if regex is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if pre in _DIGITS_FIRST
            else byte_level
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre == "qwen2":
        # Qwen2's tokenizer.json normalizes to NFC first (llama.cpp does not): follow the
        # model's own tokenizer, so a decomposed "é" tokenizes as the composed one.
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    meta: GGUFMetadata, tokens: list[str], types: Sequence[int], unk_id: int | None
) -> tokenizers.Tokenizer:
    scores = meta.value("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise TokenizerError(f"{meta.source}: SentencePiece tokenizer without one score per token")
    vocab = _vocab(tokens)
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(tokens, scores, types),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.value("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    )
    steps: list[Any] = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def sentencepiece_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary, as transformers' `SentencePieceExtractor`.

    Each normal piece yields a merge for every split into two pieces of the vocabulary; the
    merges are ranked by the piece's score, highest first (stable: splits in id order).
    """
    ids = {tok: i for i, tok in enumerate(tokens) if types[i] == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[piece_id]), ids[left], ids[right], left, right))
    ranked.sort(key=lambda m: (m[0], m[1], m[2]))
    return [(left, right) for *_, left, right in ranked]


def _vocab(tokens: list[str]) -> dict[str, int]:
    # A duplicate text keeps its first id, as in llama.cpp: built from the last id down, the
    # first id is written last.
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1), strict=True))


def _post_processor(
    backend: tokenizers.Tokenizer,
    tokens: list[str],
    ids: dict[str, int | None],
    add_bos: bool,
    add_eos: bool,
    source: str,
) -> None:
    bos, eos = ids["bos"], ids["eos"]
    if add_bos and bos is None:
        raise TokenizerError(f"{source}: add_bos_token is set but there is no bos_token_id")
    if add_eos and eos is None:
        raise TokenizerError(f"{source}: add_eos_token is set but there is no eos_token_id")
    if not (add_bos or add_eos):
        return
    head = [tokens[bos]] if add_bos and bos is not None else []
    tail = [tokens[eos]] if add_eos and eos is not None else []
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([*head, "$A", *tail, *head, "$B", *tail])
    specials = [(tokens[i], i) for i in dict.fromkeys(i for i in (bos, eos) if i is not None)]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )
