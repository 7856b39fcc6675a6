"""The training program (`meshd_train`): seeded and resumable runs, unlikelihood masks, edit
documents. Runs use the seconds-long `TINY` configuration."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from meshd_train import config, corpus, edits, loop, losses


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted `TINY` run, which the runs of the tests below must equal (or not)."""
    out = tmp_path_factory.mktemp("train") / "whole"
    loop.train(config.TINY, out, quiet=True)
    return out


@pytest.mark.slow
def test_training_is_reproducible_from_the_seed(tmp_path: Path, whole: Path) -> None:
    import dataclasses

    loop.train(config.TINY, tmp_path / "b", quiet=True)
    loop.train(dataclasses.replace(config.TINY, seed=7), tmp_path / "c", quiet=True)
    weights = [
        (d / "model.safetensors").read_bytes() for d in (whole, tmp_path / "b", tmp_path / "c")
    ]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]
    assert (whole / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_unlikelihood_marks_only_generated_tokens_that_repeat_an_ngram() -> None:
    import torch

    # prompt [1 2 3], then the model "generated" 1 2 3 1 2 9: the second "1 2" after the
    # prompt and the "2 3" repeated from the prompt complete seen bigrams; 9 is new.
    seqs = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 9]])
    mask = losses.repeated_ngram_mask(seqs, prompt_tokens=3, n=2)
    assert mask[0].tolist() == [False, False, False, False, True, True, True, True, False]
    # Phase 3: copying the prompt's bigrams is allowed; the model repeating its own is not.
    # Generated bigrams: (3,1) (1,2) (2,3) (3,1) (1,2) (2,9): the second (3,1) and (1,2).
    mine = losses.repeated_ngram_mask(seqs, prompt_tokens=3, n=2, prompt_counts=False)
    assert mine[0].tolist() == [False, False, False, False, False, False, True, True, False]


def test_unlikelihood_can_let_a_span_come_back_once_and_mark_the_loop() -> None:
    import torch

    # prompt [7 8 9], then the model writes "1 2" three times: with min_seen=2 the first
    # repeat (a copy of a line, say) goes unmarked and the third "1 2" (a loop) is marked.
    seqs = torch.tensor([[7, 8, 9, 1, 2, 1, 2, 1, 2]])
    once = losses.repeated_ngram_mask(seqs, prompt_tokens=3, n=2, prompt_counts=False)
    assert once[0].tolist() == [False] * 6 + [True, True, True]
    twice = losses.repeated_ngram_mask(seqs, prompt_tokens=3, n=2, prompt_counts=False, min_seen=2)
    # (1,2) at 4 and 6 are its first two; at 8 the third. (2,1) at 5 and 7: the second is
    # not yet a loop.
    assert twice[0].tolist() == [False] * 8 + [True]


@pytest.mark.slow
def test_a_run_resumed_at_the_phase_boundary_equals_an_uninterrupted_one(
    tmp_path: Path, whole: Path
) -> None:
    import dataclasses

    # The uninterrupted run wrote no checkpoints: writing them changes nothing either.
    cfg = dataclasses.replace(config.TINY, checkpoint_every_steps=1)
    ckpt = tmp_path / "run.ckpt"
    loop.train(cfg, tmp_path / "part", checkpoint=ckpt, quiet=True, stop_step=cfg.steps)
    loop.train(cfg, tmp_path / "resumed", checkpoint=ckpt, quiet=True)
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == (
        whole / "model.safetensors"
    ).read_bytes()
    info = json.loads((tmp_path / "resumed" / "training_info.json").read_text())
    assert info["resumed_from_step"] == cfg.steps
    assert set(info["final_phase2_losses"]) >= {"unlikelihood", "generated_repeat_fraction"}


def test_edit_samples_rename_every_use_but_attributes_and_refuse_keyword_arguments() -> None:
    source = (
        "def area(width, height):\n"
        '    """width times height."""\n'
        "    width = abs(width)  # width first\n"
        "    return box.width * width * area_of(height)\n"
    )
    (fn,) = edits.functions(source, 2000)
    assert fn.params == ("width", "height") and fn.docstring_lines == (2, 2)
    # Names are renamed; the attribute, the docstring and the comment are not.
    assert edits.rename(fn, "width", "w") == (
        "def area(w, height):\n"
        '    """width times height."""\n'
        "    w = abs(w)  # width first\n"
        "    return box.width * w * area_of(height)"
    )
    assert edits.rename(fn, "width", "height") is None  # the new name is taken
    assert edits.drop_docstring(fn) == (
        "def area(width, height):\n"
        "    width = abs(width)  # width first\n"
        "    return box.width * width * area_of(height)"
    )
    (kw,) = edits.functions("def f(x, y=1):\n    y += x\n    return g(x=x, y=y)\n", 2000)
    assert edits.rename(kw, "x", "z") is None  # g's parameter x is not ours to rename
    assert edits.rename(kw, "f", "f_v2") == "def f_v2(x, y=1):\n    y += x\n    return g(x=x, y=y)"


def test_edit_documents_repeat_their_function_edited_in_plain_and_chat_form() -> None:
    import ast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [(stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    docs = edits.edit_documents(sources, 0, 1800, corpus.render_chat)
    assert len(docs) > 10
    chats = [d for d in docs if d.startswith("<|user|>")]
    plain = [d for d in docs if not d.startswith("<|user|>")]
    assert chats and plain
    for doc in plain:
        original, _, rest = doc.partition("\n\n\n# ")
        _, _, edited = rest.partition("\n")
        ast.parse(original)
        ast.parse(edited)
        assert edited.rstrip() != original.rstrip()
        # An edit keeps most of the text: the answer is mostly a copy of the prompt.
        assert len(set(edited.split("\n")) & set(original.split("\n"))) >= 1
    for doc in chats:
        reply = doc.split("<|assistant|>\n```python\n", 1)[1].split("\n```<|end|>", 1)[0]
        ast.parse(reply)
    assert docs == edits.edit_documents(sources, 0, 1800, corpus.render_chat)  # seeded


@pytest.mark.slow
def test_phases_3_and_4_from_an_exported_directory_equal_an_uninterrupted_run(
    tmp_path: Path, whole: Path
) -> None:
    cfg = config.TINY
    loop.train(cfg, tmp_path / "phase2", quiet=True, stop_step=loop.phase3_start(cfg))
    loop.train(cfg, tmp_path / "from2", quiet=True, init_from=tmp_path / "phase2")
    loop.train(cfg, tmp_path / "phase3", quiet=True, stop_step=loop.phase4_start(cfg))
    loop.train(cfg, tmp_path / "from3", quiet=True, init_from=tmp_path / "phase3")
    whole_info = json.loads((whole / "training_info.json").read_text())
    for start in ("phase2", "phase3"):
        done = tmp_path / f"from{start[-1]}"
        assert (done / "model.safetensors").read_bytes() == (
            whole / "model.safetensors"
        ).read_bytes()
        info = json.loads((done / "training_info.json").read_text())
        assert info["initialised_from"] == str(tmp_path / start)
        for key in ("final_train_losses", "final_phase2_losses", "final_phase3_losses"):
            assert info[key] == whole_info[key], (start, key)
        assert info["final_phase4_losses"] == whole_info["final_phase4_losses"]
    exported = json.loads((whole / "config.json").read_text())
    assert exported["max_position_embeddings"] == cfg.edit_context_tokens
