"""Tokenizers rebuilt from GGUF metadata encode and decode like the tokenizer.json they came from."""

from __future__ import annotations

import json
import pathlib

import gguf
import pytest
import tokenizers
from tokenizers import decoders, pre_tokenizers

from meshd.bench.gguf_writer import write_gguf, write_sentencepiece_gguf, write_vocab_gguf
from meshd.bench.tokenizer_dirs import SENTENCES, SP_TEXTS, byte_level_dir, sentencepiece_dir
from meshd.model.builtin import builtin_model_dir
from meshd.model.errors import TokenizerError
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.tokenizer import Tokenizer

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand  double  spaces",
    "Numbers: 3 33 333 3333 3.14159 1,000,000",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, нещо на Български",
    "Emoji 🚀🦙 and joiners 😶\u200d🌫️!",
    "Contractions: I've, you're, he'll, she'd, it's, we'RE, THEY'LL",
    "<|user|>\nHi there<|end|>\n<|assistant|>\n",
    "punctuation!!! ??? ... --- === ``` \"quotes\" 'single'",
    "",
]


@pytest.fixture(scope="module")
def builtin_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Tokenizer]:
    path = write_gguf(builtin_model_dir(), tmp_path_factory.mktemp("tok") / "builtin.gguf")
    return open_tokenizer(path), open_tokenizer(builtin_model_dir())


def test_byte_level_bpe_from_gguf_matches_tokenizer_json(
    builtin_pair: tuple[Tokenizer, Tokenizer],
) -> None:
    ours, theirs = builtin_pair
    assert ours.vocab_size == theirs.vocab_size
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
        ids = theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.eos_ids == theirs.eos_ids == (0, 4)
    assert ours.special_tokens["eos_token"] == theirs.special_tokens["eos_token"]
    assert ours.chat_template == theirs.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☕"}]
    assert ours.encode_chat(chat) == theirs.encode_chat(chat)
    ids = theirs.encode("Stream ☕ me, 日本語 🚀")
    streams = [tok.stream() for tok in (ours, theirs)]
    assert ["".join(s.push(i) for i in ids) + s.flush() for s in streams] == [
        "Stream ☕ me, 日本語 🚀"
    ] * 2


def test_the_daemon_opens_the_gguf_as_one_model_file(tmp_path: pathlib.Path) -> None:
    path = write_gguf(builtin_model_dir(), tmp_path / "builtin.gguf", "Q8_0")
    checkpoint, tokenizer = open_checkpoint(path), open_tokenizer(path)
    assert checkpoint.config.vocab_size == tokenizer.vocab_size
    assert checkpoint.config.eos_token_ids == tokenizer.eos_ids
    assert checkpoint.config.bos_token_id == 0  # llama.cpp's converter reads config.json's
    # A split file's tokenizer is in its first shard, whichever shard is named.
    write_gguf(builtin_model_dir(), tmp_path / "split.gguf", "Q8_0", split_max_tensors=20)
    last = sorted(tmp_path.glob("split-*-of-*.gguf"))[-1]
    assert open_tokenizer(last).encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])
    assert open_checkpoint(last).model_id != checkpoint.model_id


# The split regexes of Llama 3's and Qwen2's tokenizer.json (as published with the models).
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_llama3_and_qwen2_style_byte_level_bpe_from_gguf(tmp_path: pathlib.Path, pre: str) -> None:
    src = byte_level_dir(tmp_path / "src", pre, SENTENCES + TEXTS)
    theirs = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    ours = open_tokenizer(write_vocab_gguf(src, tmp_path / "v.gguf", pre))
    for text in [*TEXTS, "e\u0301 composed: \u00e9", "12345678 digits 3.14"]:
        ids = theirs.encode(text).ids
        assert ours.encode(text) == ids, (pre, text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)
    # eos, plus the end-of-turn token llama.cpp also stops at.
    assert ours.eos_ids == ((1, 2) if pre == "llama-bpe" else (0, 2))


def test_smollm_style_byte_level_bpe_splits_digits_first(tmp_path: pathlib.Path) -> None:
    # SmolLM's tokenizer.json: every digit its own piece, then GPT-2's byte-level split.
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*SENTENCES, *TEXTS, "2024 1999 31337 42"] * 3, trainer)
    src = tmp_path / "src"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    ours = open_tokenizer(write_vocab_gguf(src, tmp_path / "v.gguf", "smollm"))
    for text in [*TEXTS, "12345678 digits 3.14 in 2024"]:
        ids = tok.encode(text).ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == tok.decode(ids, skip_special_tokens=False)
    assert len(ours.encode("2024")) == 4


# --- SentencePiece ("llama") -------------------------------------------------------------


def test_sentencepiece_bpe_from_gguf_matches_tokenizer_json(tmp_path: pathlib.Path) -> None:
    src = sentencepiece_dir(tmp_path / "sp")
    theirs = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    ours = open_tokenizer(write_sentencepiece_gguf(src, tmp_path / "sp.gguf"))
    assert ours.vocab_size == theirs.get_vocab_size()
    for text in SP_TEXTS:
        ids = theirs.encode(text).ids
        assert ours.encode(text) == ids, (text, ours.encode(text), ids)
        assert ours.encode(text, add_special_tokens=False) == ids[1:]
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids)
    assert "<0xC3>" in [theirs.id_to_token(i) for i in theirs.encode("naïve").ids]  # fallback used
    assert ours.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert ours.bos_id == 1 and ours.eos_ids == (2,)


def test_unsupported_tokenizers_are_one_line_errors(tmp_path: pathlib.Path) -> None:
    for key, value, words in (
        ("tokenizer.ggml.pre", "starcoder", ["starcoder", "pre-tokenizer"]),
        ("tokenizer.ggml.model", "bert", ["bert", "tokenizer model"]),
    ):
        path = tmp_path / f"{value}.gguf"
        _write_vocab_only(path, {key: value})
        with pytest.raises(TokenizerError) as exc:
            open_tokenizer(path)
        text = str(exc.value)
        assert "\n" not in text and all(w in text for w in words), text


def _write_vocab_only(dest: pathlib.Path, overrides: dict[str, str]) -> None:
    """A GGUF holding only the builtin vocabulary, with some keys replaced."""
    full = dest.with_suffix(".full.gguf")
    write_gguf(builtin_model_dir(), full)
    reader = gguf.GGUFReader(full)
    writer = gguf.GGUFWriter(dest, "llama")
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer.") or field.name in overrides:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, field.contents())
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    for key, value in overrides.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
