"""Code-edit samples for the built-in model's third training phase.

A code-editing answer repeats its prompt with changes: the function comes back renamed, with
an argument renamed, or without its docstring. Plain next-token training on the standard
library teaches a small model almost none of that (the library rarely repeats a function
with an edit), so phase 3 of the training loop (`meshd_train.loop`) adds documents that do exactly this, built
mechanically from the training files' own functions so every edited copy is correct code:

    <function>                                   # plain form (2 in 3)
    # The same function as f, renamed to f_v2.   # one of several phrasings per edit
    <the edited function>

    <|user|> Rename the argument `x` to `y` in this function: ```python <function> ```<|end|>
    <|assistant|> ```python <the edited function> ```<|end|>          # chat form (1 in 3)

Renames go through `tokenize`: every NAME token equal to the old name is renamed except an
attribute (`obj.name`); a function that passes the name as a keyword argument (`g(x=...)`
in its body) is skipped rather than renamed wrongly, and every result must parse.
"""

from __future__ import annotations

import ast
import io
import keyword
import random
import textwrap
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass

FUNCTION_RENAMES = ("{}_v2", "{}_new", "{}2", "{}_impl", "{}_copy", "{}_old", "new_{}", "my_{}")
ARGUMENT_RENAMES = ("{}_value", "new_{}", "{}2", "the_{}", "{}_arg", "{}_")
PLAIN_COMMENTS = {
    "function": (
        "# The same function as {old}, renamed to {new}.",
        "# {old} again, under the name {new}.",
        "# A copy of {old} named {new}.",
    ),
    "argument": (
        "# The same function with the argument {old} renamed to {new}.",
        "# {name} again, with {old} renamed to {new}.",
    ),
    "docstring": (
        "# The same function as {name}, without its docstring.",
        "# {name} without the docstring.",
    ),
}
CHAT_REQUESTS = {
    "function": "Rename the function `{old}` to `{new}`:",
    "argument": "Rename the argument `{old}` to `{new}` in this function:",
    "docstring": "Remove the docstring from this function:",
}


@dataclass(frozen=True)
class Function:
    """One function of a source file, dedented to column 0."""

    name: str
    source: str
    params: tuple[str, ...]
    body_line: int  # 1-based line (in `source`) of the first body statement
    docstring_lines: tuple[int, int] | None  # 1-based inclusive range, when there is one


@dataclass(frozen=True)
class Edit:
    """An edited copy of a function and the words that ask for it."""

    kind: str  # "function", "argument" or "docstring"
    old: str
    new: str
    edited: str


def functions(source: str, max_chars: int) -> Iterator[Function]:
    """Every function (methods too) of at least three lines and at most `max_chars`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.end_lineno is None or node.decorator_list:
            continue
        text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
        if len(text) > max_chars or text.count("\n") < 2:
            continue
        args = node.args
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        every += [a for a in (args.vararg, args.kwarg) if a is not None]
        params = tuple(a.arg for a in every if a.arg not in ("self", "cls"))
        doc = None
        first = node.body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
            and first.end_lineno is not None
            and len(node.body) > 1
        ):
            doc = (first.lineno - node.lineno + 1, first.end_lineno - node.lineno + 1)
        body = node.body[0].lineno - node.lineno + 1
        yield Function(node.name, text, params, body, doc)


def rename(fn: Function, old: str, new: str) -> str | None:
    """`fn.source` with identifier `old` renamed to `new`, or None where that is unsafe."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(fn.source + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    if any(t.type == tokenize.NAME and t.string == new for t in tokens):
        return None  # the new name is taken
    hits: list[tuple[int, int]] = []
    depth = 0
    previous = ""
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        if tok.type == tokenize.NAME and tok.string == old and previous != ".":
            following = tokens[i + 1] if i + 1 < len(tokens) else None
            keyword_arg = following is not None and following.string == "=" and depth > 0
            if keyword_arg and tok.start[0] >= fn.body_line:
                return None  # g(old=...) names g's parameter, not ours
            hits.append(tok.start)
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT):
            previous = tok.string
    if not hits:
        return None
    lines = fn.source.split("\n")
    for row, col in reversed(hits):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    edited = "\n".join(lines)
    try:
        ast.parse(edited)
    except SyntaxError:
        return None
    return edited


def drop_docstring(fn: Function) -> str | None:
    """`fn.source` without its docstring (None when it has none)."""
    if fn.docstring_lines is None:
        return None
    first, last = fn.docstring_lines
    lines = fn.source.split("\n")
    edited = "\n".join(lines[: first - 1] + lines[last:])
    try:
        ast.parse(edited)
    except SyntaxError:
        return None
    return edited


def _fresh_name(pattern_choices: tuple[str, ...], name: str, rng: random.Random) -> str:
    new = rng.choice(pattern_choices).format(name)
    return new + "_" if keyword.iskeyword(new) else new


def choose_edit(fn: Function, rng: random.Random) -> Edit | None:
    """A seeded edit of `fn`: rename it (40 %), rename an argument (40 %), drop its docstring."""
    roll = rng.random()
    if roll < 0.4 or (roll < 0.8 and not fn.params):
        new = _fresh_name(FUNCTION_RENAMES, fn.name, rng)
        edited = rename(fn, fn.name, new)
        return None if edited is None else Edit("function", fn.name, new, edited)
    if roll < 0.8:
        old = rng.choice(fn.params)
        new = _fresh_name(ARGUMENT_RENAMES, old, rng)
        edited = rename(fn, old, new)
        return None if edited is None else Edit("argument", old, new, edited)
    edited = drop_docstring(fn)
    return None if edited is None else Edit("docstring", fn.name, fn.name, edited)


def edit_document(
    fn: Function,
    edit: Edit,
    rng: random.Random,
    render_chat: Callable[[list[dict[str, str]]], str],
) -> str:
    """One training document asking for `edit` of `fn` and answering it."""
    words = {"old": edit.old, "new": edit.new, "name": fn.name}
    if rng.random() < 2 / 3:
        comment = rng.choice(PLAIN_COMMENTS[edit.kind]).format(**words)
        return f"{fn.source}\n\n\n{comment}\n{edit.edited}\n"
    request = CHAT_REQUESTS[edit.kind].format(**words)
    user = f"{request}\n```python\n{fn.source}\n```"
    reply = f"```python\n{edit.edited}\n```"
    return render_chat([{"role": "user", "content": user}, {"role": "assistant", "content": reply}])


def edit_documents(
    sources: list[str],
    seed: int,
    max_chars: int,
    render_chat: Callable[[list[dict[str, str]]], str],
) -> list[str]:
    """One edit document per eligible function of `sources`, in a seeded order."""
    rng = random.Random(seed)
    docs = []
    for source in sources:
        for fn in functions(source, max_chars):
            edit = choose_edit(fn, rng)
            if edit is not None:
                docs.append(edit_document(fn, edit, rng, render_chat))
    rng.shuffle(docs)
    return docs
