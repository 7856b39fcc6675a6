"""Small tokenizers to test and measure with: byte-level BPE laid out like Llama 3's or
Qwen2's, and SentencePiece-style BPE like Llama 2's, trained here on given text (tokenizer.json
and tokenizer_config.json in a directory, as Hugging Face checkpoints hold them)."""

from __future__ import annotations

import json
import pathlib

import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers, processors

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_dir(
    directory: pathlib.Path, pre: str, sentences: list[str], vocab_size: int = 1000
) -> pathlib.Path:
    """A byte-level BPE tokenizer.json laid out like Llama 3's (`llama-bpe`: split regex,
    ignore_merges, BOS template) or Qwen2's (`qwen2`: NFC, split regex), trained here."""
    regex = LLAMA3_SPLIT if pre == "llama-bpe" else QWEN2_SPLIT
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    if pre == "qwen2":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(ignore_merges=pre == "llama-bpe"))
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences, trainer)
    config: dict[str, object] = {"eos_token": specials[1 if pre == "llama-bpe" else 0]}
    if pre == "llama-bpe":
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)],
        )
        config |= {"bos_token": "<|begin_of_text|>", "add_bos_token": True}
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "the lazy dog sleeps in the warm sun all day",
    "a quick brown dog jumps over a sleeping fox",
    "foxes and dogs are not the best of friends",
    "over and over the fox jumps the dog",
    "sunny days are the best days for lazy dogs",
] * 4
SP_TEXTS = [
    *SENTENCES[:6],
    "The Quick Brown FOX",  # capitals the training text never had: characters and bytes
    "jumps  twice   with spaces ",
    "naïve café ☕ 日本",  # byte fallback
    "<s> is text here, not the control token",
    "",
]
SPACE = "\u2581"


def sentencepiece_dir(
    directory: pathlib.Path, sentences: list[str] = SENTENCES, vocab_size: int = 400
) -> pathlib.Path:
    """A Llama-2-style tokenizer.json (BPE, byte fallback, ▁ spaces) trained on `sentences`."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer_model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    trainer_model.normalizer = normalizers.Replace(" ", SPACE)
    # SentencePiece never merges across words: train on ▁-prefixed words.
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials + byte_tokens, show_progress=False
    )
    trainer_model.train_from_iterator(sentences, trainer)
    trained = json.loads(trainer_model.to_str())["model"]
    pairs = [m.split(" ") if isinstance(m, str) else m for m in trained["merges"]]
    merges = [(a, b) for a, b in pairs]
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=trained["vocab"],
            merges=merges,
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in specials]
    )
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return directory
