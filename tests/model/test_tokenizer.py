"""Tokenizer: round trip, chat template rendering like transformers, streaming detokenization."""

from __future__ import annotations

import json
import pathlib

import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshd.model.errors import MissingFile, TokenizerError
from meshd.model.tokenizer import Tokenizer

CORPUS = [
    "def greet(name):\n    return f'héllo {name} ✓'\n",
    "class Point:\n    x: int = 0  # 座標 ✨\n",
    "print('naïve café — 日本語のテキスト 🐍🐍')\n",
] * 20
SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "  Sort a list — quickly ✓ "},
    {"role": "assistant", "content": "sorted(xs)"},
    {"role": "user", "content": "And reversed?"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("tok")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": {"content": "<|end|>", "special": True, "__type": "AddedToken"},
                "chat_template": TEMPLATE,
            }
        )
    )
    eos = backend.token_to_id("<|endoftext|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return directory


def test_round_trip_and_special_ids(tok_dir: pathlib.Path) -> None:
    tok = Tokenizer.open(tok_dir)
    for text in CORPUS[:3]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())  # merges were learned, not just bytes
    end, eot = tok.token_to_id("<|end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.bos_id == eot
    assert set(tok.eos_ids) == {end, eot}
    assert tok.decode([end, *tok.encode("x")], skip_special_tokens=True) == "x"


def test_chat_template_renders_like_transformers(tok_dir: pathlib.Path) -> None:
    tok = Tokenizer.open(tok_dir)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir)
    for add in (True, False):
        ours = tok.render_chat(MESSAGES, add_generation_prompt=add)
        theirs = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours == theirs
        assert ours.startswith("<|endoftext|><|system|>\n") and ours.endswith(
            "<|assistant|>\n" if add else "<|end|>\n"
        )
    hf_ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "input_ids"):
        hf_ids = hf_ids["input_ids"]
    assert tok.encode_chat(MESSAGES) == list(hf_ids)


def test_chat_template_errors_are_typed(tok_dir: pathlib.Path) -> None:
    tok = Tokenizer.open(tok_dir)
    with pytest.raises(TokenizerError, match="unknown role tool"):
        tok.render_chat([{"role": "tool", "content": "x"}])
    sandboxed = Tokenizer(tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json")))
    with pytest.raises(TokenizerError, match="no chat template"):
        sandboxed.render_chat(MESSAGES)
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(TokenizerError):
        Tokenizer(sandboxed._backend, chat_template=escape).render_chat(MESSAGES)


def test_missing_tokenizer_file_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(MissingFile, match=r"tokenizer\.json"):
        Tokenizer.open(tmp_path)


def test_streaming_equals_whole_decode_and_never_splits_a_character(tok_dir: pathlib.Path) -> None:
    tok = Tokenizer.open(tok_dir)
    text = "".join(CORPUS[:3]) + "emoji 🐍✨ then 日本 done"
    ids = tok.encode(text)
    # Some tokens must end inside a multi-byte character for this test to mean anything.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    stream = tok.stream()
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # something was held back until its character completed
