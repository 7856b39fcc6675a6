"""The corpus and its token streams: the running interpreter's standard library split into
training and held-out files, chat samples, the tokenizer, edit documents (`edits`), and the
batches of every phase, each a pure function of (seed, step)."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshd_train import edits
from meshd_train.config import TrainConfig

EOT = "<|endoftext|>"


END = "<|end|>"


ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")


SPECIAL_TOKENS = (EOT, *ROLE_TOKENS, END)


# Roles are written as their special token; each turn ends with <|end|> so a chat reply stops
# on a single token that code never contains.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"}


@dataclass(frozen=True)
class Corpus:
    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]
    sha256: str
    stdlib: str


def is_heldout(relpath: str, per_mille: int) -> bool:
    """Stable split by file: the first 4 bytes of sha256(relative path) mod 1000."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < per_mille


def load_corpus(cfg: TrainConfig) -> Corpus:
    """Read the stdlib `*.py` files, minus tests, site-packages and generated tables."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS.intersection(rel.split("/")[:-1]):
            continue
        if path.stat().st_size > cfg.max_file_bytes:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        # Codec tables (encodings/cp*.py) and similar are machine output, not code to learn.
        if "generated" in text[:400].lower():
            continue
        files.append((rel, text))
        if len(files) == cfg.max_files:  # tiny runs stop early; 0 never matches
            break
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    train = [f for f in files if not is_heldout(f[0], cfg.heldout_per_mille)]
    heldout = [f for f in files if is_heldout(f[0], cfg.heldout_per_mille)]
    return Corpus(train, heldout, h.hexdigest(), str(root))


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (identical output to CHAT_TEMPLATE)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_samples(source: str) -> Iterator[str]:
    """Turn each documented function into a chat exchange (two alternating task kinds)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2 or node.end_lineno is None:
            continue
        func = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        func = _dedent(func)
        if len(func) > 2000:
            continue
        body_start = node.body[1].lineno - 1
        head = _dedent("\n".join(lines[node.lineno - 1 : body_start]))
        body = func[len(head) :].lstrip("\n")
        if node.lineno % 2:
            user = f"Complete this Python function:\n```python\n{head}\n```"
            reply = f"```python\n{body}\n```"
        else:
            user = f"Write a Python function `{node.name}` that does this:\n{doc}"
            reply = f"```python\n{func}\n```"
        system = [{"role": "system", "content": "You are a helpful Python coding assistant."}]
        convo = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        yield render_chat((system if node.lineno % 3 == 0 else []) + convo)


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).rstrip()


def build_documents(corpus: Corpus, cfg: TrainConfig) -> list[str]:
    """Plain files plus a seeded sample of chat exchanges, in a seeded order."""
    rng = random.Random(cfg.seed)
    docs = [text for _, text in corpus.train]
    chats = [c for _, text in corpus.train for c in chat_samples(text)]
    rng.shuffle(chats)
    budget = cfg.chat_fraction_of_bytes * sum(map(len, docs))
    for chat in chats:
        if budget <= 0:
            break
        docs.append(chat)
        budget -= len(chat)
    rng.shuffle(docs)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the chat specials reserved as ids 0..4."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """One long token stream; each document is preceded by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.append(eot)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def batch_at(stream: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """The step's batch of windows, a pure function of (seed, step)."""
    span = cfg.context_tokens + 1 + cfg.mtp_depths
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - span, (cfg.batch_sequences,), generator=gen)
    return torch.stack([stream[s : s + span] for s in starts.tolist()]).long()


def ul_prompts(stream: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """Phase-2 prompts: training windows drawn from (seed, step) like `batch_at`."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 500_009 + step)
    n = cfg.ul_prompt_tokens
    starts = torch.randint(0, len(stream) - n, (cfg.ul_batch_sequences,), generator=gen)
    return torch.stack([stream[s : s + n] for s in starts.tolist()]).long()


@dataclass(frozen=True)
class EditStream:
    """Phase-3 edit documents as one token stream, and where each document starts."""

    ids: torch.Tensor
    starts: torch.Tensor
    documents: int


def encode_edit_stream(tok: Tokenizer, corpus: Corpus, cfg: TrainConfig) -> EditStream:
    """The training files' edit documents (`meshd_train.edits`), each preceded by <|endoftext|>."""
    docs = edits.edit_documents(
        [text for _, text in corpus.train], cfg.seed + 3, cfg.edit_max_function_chars, render_chat
    )
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    starts: list[int] = []
    for enc in tok.encode_batch(docs):
        starts.append(len(ids))
        ids.append(eot)
        ids.extend(enc.ids)
    # Every window of the phase must fit from its start; pad the tail with end-of-text.
    ids.extend([eot] * (cfg.edit_context_tokens + 1 + cfg.mtp_depths))
    return EditStream(
        torch.tensor(ids, dtype=torch.int32), torch.tensor(starts, dtype=torch.long), len(docs)
    )


def phase3_batch(
    stream: torch.Tensor, edits: EditStream, step: int, cfg: TrainConfig
) -> torch.Tensor:
    """Plain long windows from the code stream, then edit windows that start at a document."""
    plain_cfg = dataclasses.replace(
        cfg, context_tokens=cfg.edit_context_tokens, batch_sequences=cfg.edit_plain_sequences
    )
    plain = batch_at(stream, step, plain_cfg)
    span = cfg.edit_context_tokens + 1 + cfg.mtp_depths
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 700_001 + step)
    picks = torch.randint(0, len(edits.starts), (cfg.edit_sample_sequences,), generator=gen)
    rows = [edits.ids[s : s + span] for s in edits.starts[picks].tolist()]
    return torch.cat([plain, torch.stack(rows).long()])
