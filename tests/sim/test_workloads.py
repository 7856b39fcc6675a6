"""The benchmark workloads: real text, and edits of code the built-in model never trained on."""

from __future__ import annotations

import importlib
import json
import sysconfig
from importlib import resources
from pathlib import Path

from meshd.sim.workloads import EDIT_SOURCES, workloads

BUILTIN = Path(str(resources.files("meshd.model") / "builtin"))


def test_edit_prompts_come_from_the_built_in_models_held_out_files() -> None:
    info = json.loads((BUILTIN / "training_info.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for module, _ in EDIT_SOURCES:
        path = Path(importlib.import_module(module).__file__ or "")
        assert path.relative_to(stdlib).as_posix() in info["heldout_files"]


def test_each_kind_has_its_prompts_and_an_edit_asks_for_the_renamed_function() -> None:
    loads = workloads(2)
    assert [w.kind for w in loads] == ["edit"] * 2 + ["completion"] * 2 + ["prose"] * 2
    edit = loads[0]
    name = edit.name.split(".")[1]
    assert f"def {name}(" in edit.prompt
    assert edit.prompt.endswith(f"def {name}_v2(heap, pos):")


def test_every_kind_has_three_prompts_each_a_different_text() -> None:
    kinds = ("edit", "completion", "prose", "chat")
    loads = workloads(3, kinds)
    assert [w.kind for w in loads] == [k for k in kinds for _ in range(3)]
    assert len({w.prompt for w in loads}) == len(loads)
    # Prose prompts are 40 words of English, not a one-line module summary.
    assert all(len(w.prompt.split()) == 40 for w in loads if w.kind == "prose")


def test_a_chat_workload_is_a_conversation_rendered_with_the_models_template() -> None:
    from meshd.bench.spec import encode_workload
    from meshd.model.tokenizer import Tokenizer

    chats = workloads(3, ("chat",))
    assert len(chats) == 3 and {w.kind for w in chats} == {"chat"}
    for chat in chats:
        roles = [role for role, _ in chat.messages]
        assert roles == ["system", "user", "assistant", "user"]
        # The earlier answer holds the function the last turn asks to change.
        assert f"def {chat.name.split('.')[1]}(" in chat.messages[2][1]
    tokenizer = Tokenizer.open(BUILTIN)
    assert tokenizer.chat_template is not None
    messages = [{"role": r, "content": c} for r, c in chats[0].messages]
    assert encode_workload(tokenizer, chats[0]) == tokenizer.encode_chat(messages)
    assert encode_workload(tokenizer, chats[0]) != tokenizer.encode(chats[0].prompt)
