"""Benchmark workloads built from the Python standard library's own source (on every machine).

Three kinds, as the speculative benchmark reads them:
- code editing: the answer repeats the prompt with changes (a function, then the same
  function again under a new name: the model copies the body back);
- code completion: the start of a function, continued by the model;
- prose: English text (module docstrings), continued by the model.
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
PROSE_MODULES = ["heapq", "bisect", "difflib"]


@dataclass(frozen=True)
class Workload:
    """One benchmark prompt."""

    kind: str  # "edit", "completion", "prose"
    name: str
    prompt: str


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


def workloads(per_kind: int) -> list[Workload]:
    """Up to `per_kind` prompts of each kind, in a fixed order."""
    out: list[Workload] = []
    for make, sources in ((_edit, EDIT_SOURCES), (_completion, COMPLETION_SOURCES)):
        made = [w for w in (make(m, a) for m, a in sources) if w is not None]
        out += made[:per_kind]
    out += [w for w in (_prose(m) for m in PROSE_MODULES) if w is not None][:per_kind]
    return out
