"""Benchmark workloads built from the Python standard library's own source (on every machine).

Four kinds, as the speculative benchmark reads them:
- code editing: the answer repeats the prompt with changes (a function, then the same
  function again under a new name: the model copies the body back);
- code completion: the start of a function, continued by the model;
- prose: English text (module docstrings), continued by the model;
- chat: a multi-turn conversation (a function asked for and given, then a change to it asked
  for), rendered with the model's chat template where it has one; the answer is new text that
  reuses the earlier turn's.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

# (module, attribute) pairs; chosen for size and variety, all pure-Python and stable across
# CPython 3.11+. A missing one is skipped, so the list tolerates other Python versions.
# The editing functions come from files the built-in model never saw in training (its held-out
# split, meshd_train/corpus.py: heapq.py, copyreg.py, selectors.py), which was trained on
# edits of other functions: the benchmark asks for an edit, not for a memorised text.
EDIT_SOURCES = [("heapq", "_siftup"), ("copyreg", "add_extension"), ("selectors", "_can_use")]
COMPLETION_SOURCES = [("base64", "b64encode"), ("colorsys", "rgb_to_hls"), ("calendar", "weekday")]
PROSE_MODULES = ["heapq", "csv", "difflib"]
# (module, attribute, the change asked for in the last turn)
CHAT_SOURCES = [
    ("textwrap", "indent", "Add type hints to it and explain each parameter in a docstring."),
    ("shlex", "quote", "Rewrite it without the regular expression, keeping its behaviour."),
    ("fnmatch", "filter", "Make it return a generator instead of a list, and say why."),
]


@dataclass(frozen=True)
class Workload:
    """One benchmark prompt."""

    kind: str  # "edit", "completion", "prose", "chat"
    name: str
    prompt: str  # the text (a chat's turns as plain text, for a model without a template)
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) of a chat, in order


def _source(module: str, attr: str) -> str | None:
    try:
        return inspect.getsource(getattr(importlib.import_module(module), attr))
    except (ImportError, AttributeError, OSError, TypeError):
        return None


def _edit(module: str, attr: str) -> Workload | None:
    src = _source(module, attr)
    if src is None:
        return None
    lines = src.rstrip().splitlines()
    renamed = lines[0].replace(f"def {attr}(", f"def {attr}_v2(", 1)
    # Prompts end at the end of a line, not after its newline: byte-level BPE joins a newline
    # with the next line's indentation, so a prompt ending in a bare newline token would start
    # the answer at a token boundary that training never shows (the model then starts a new
    # top-level statement instead of the body).
    prompt = f"{src.rstrip()}\n\n\n# The same function as {attr}, renamed to {attr}_v2.\n{renamed}"
    return Workload("edit", f"{module}.{attr}", prompt)


def _completion(module: str, attr: str) -> Workload | None:
    src = _source(module, attr)
    if src is None:
        return None
    head = "\n".join(src.splitlines()[:8])
    return Workload("completion", f"{module}.{attr}", head)


def _prose(module: str) -> Workload | None:
    try:
        doc = inspect.getdoc(importlib.import_module(module)) or ""
    except ImportError:
        return None
    words = doc.split()
    if len(words) < 30:
        return None
    return Workload("prose", module, '"""' + " ".join(words[:40]))


def _chat(module: str, attr: str, change: str) -> Workload | None:
    src = _source(module, attr)
    if src is None:
        return None
    messages = (
        ("system", "You are a helpful Python programming assistant."),
        ("user", f"Show me the source of {module}.{attr} from the standard library."),
        ("assistant", f"Here it is:\n\n```python\n{src.rstrip()}\n```"),
        ("user", change),
    )
    text = "\n\n".join(f"{role}: {content}" for role, content in messages) + "\n\nassistant:"
    return Workload("chat", f"{module}.{attr}", text, messages)


def workloads(
    per_kind: int, kinds: tuple[str, ...] = ("edit", "completion", "prose")
) -> list[Workload]:
    """Up to `per_kind` prompts of each of `kinds`, in a fixed order."""
    made: dict[str, list[Workload | None]] = {
        "edit": [_edit(m, a) for m, a in EDIT_SOURCES],
        "completion": [_completion(m, a) for m, a in COMPLETION_SOURCES],
        "prose": [_prose(m) for m in PROSE_MODULES],
        "chat": [_chat(m, a, c) for m, a, c in CHAT_SOURCES],
    }
    out: list[Workload] = []
    for kind in kinds:
        out += [w for w in made[kind] if w is not None][:per_kind]
    return out
