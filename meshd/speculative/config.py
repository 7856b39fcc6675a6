"""Typed configuration of speculative decoding, its validation and its precedence.

Every key is a field of `SpecConfig`. A key may be set at four levels; the higher level wins:
request > CLI > config file > model defaults (and the built-in default below all of them).
Each level is given as a dict holding only the keys explicitly set there, so "not set" and
"set to the default" stay distinguishable. Every key also has a `--speculative-*` CLI flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

STRATEGIES: tuple[str, ...] = (
    "disabled",
    "ngram-simple",
    "ngram-cache",
    "mtp",
    "mtp-simple",
    "mtp-cache",
    "draft",
    "draft-ngram",
    "auto",
)
# The strategies that draft from the last stage's MTP heads (`auto` may choose one of them).
MTP_STRATEGIES: tuple[str, ...] = ("mtp", "mtp-simple", "mtp-cache")
# The strategies that draft with the node's draft model (`spec.draft_model`).
DRAFT_STRATEGIES: tuple[str, ...] = ("draft", "draft-ngram")
# Keys only the node sets (config file, environment, flags): a request naming one is refused.
NODE_ONLY_KEYS: tuple[str, ...] = ("draft_model",)

LEVELS: tuple[str, ...] = ("model defaults", "config file", "CLI", "request")


class SpecConfigError(ValueError):
    """A speculative-decoding key is unknown, mistyped or out of range. `SpecConfig`'s own
    checks start the message with the key, as every table of the daemon's config does.

    `key` names the offending key; `level` names where it was set ("request", "CLI",
    "config file", "model defaults" or "built-in default" for cross-field checks on defaults).
    """

    def __init__(self, message: str, *, key: str, level: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.level = level


class SpecConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Speculative decoding settings (all validated; see `RULES` for the allowed ranges)."""

    strategy: str = "auto"
    # Drafted tokens per verify window when speculating (0 = no speculation at all).
    window_min_tokens: int = 1
    window_max_tokens: int = 8
    # Verify windows in flight at once (1 = wait for each reply before sending the next).
    max_pipeline_depth: int = 2
    # n-gram context lengths tried, longest first.
    ngram_min: int = 2
    ngram_max: int = 4
    # ngram-cache proposes a continuation only when it was seen at least this often.
    ngram_cache_min_hits: int = 2
    # Tokens drafted by the model's MTP heads (the last stage runs this many depths, at most
    # as many as the checkpoint has; the built-in model has 2).
    mtp_depth: int = 2
    # n-gram tokens appended after the MTP prefix by mtp-simple / mtp-cache (2 MTP + 6 = the
    # default window of 8).
    extension_tokens: int = 6
    # Weight of the newest observation in the acceptance EWMAs.
    ewma_alpha: float = 0.2
    # Acceptance assumed per draft position before anything was measured.
    prior_acceptance: float = 0.5
    # Speculate only when the model predicts at least this speedup over no speculation.
    min_speedup: float = 1.05
    # The draft model's checkpoint (a directory or .gguf; "" = none): loaded once by the
    # coordinator, it drafts for `draft`, `draft-ngram` and `auto`. Its tokenizer must be the
    # target's (a prefix of the target's vocabulary is allowed).
    draft_model: str = ""
    # Draft-model choices computed ahead while a window is in flight (its bonus token's guess
    # and the next window's drafts; 0 = none): where they hold, the next window leaves without
    # waiting for a draft pass. Off by default: where the coordinator's cores and memory also
    # run a stage, the passes ahead slow that stage by what they save (docs/speculative.md).
    draft_ahead_tokens: int = 0
    # The draft model scores only its first this many vocabulary ids, the EOS ids and those
    # of the request's own log (0 = all): its head is a third of a small draft's pass, and a
    # token it cannot propose costs one rejected draft, never a changed output.
    draft_vocab_tokens: int = 32768

    def __post_init__(self) -> None:
        for key, rule in RULES.items():
            rule.check(key, getattr(self, key))
        if self.window_min_tokens > self.window_max_tokens:
            raise SpecConfigError(
                f"window_min_tokens ({self.window_min_tokens}) must not "
                f"exceed window_max_tokens ({self.window_max_tokens})",
                key="window_min_tokens",
            )
        if self.strategy in DRAFT_STRATEGIES and not self.draft_model:
            raise SpecConfigError(
                f"strategy {self.strategy!r} needs a draft model, and "
                f"this node has none (spec.draft_model / --speculative-draft-model)",
                key="strategy",
            )
        if self.ngram_min > self.ngram_max:
            raise SpecConfigError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})",
                key="ngram_min",
            )


@dataclass(frozen=True)
class Rule:
    """The type and the inclusive range (numbers) or the choices (strings) allowed for a key."""

    kind: type
    low: float | None = None
    high: float | None = None
    help: str = ""
    choices: tuple[str, ...] = ()

    def check(self, key: str, value: object) -> None:
        """Raise `SpecConfigError` naming `key` when `value` breaks this rule."""
        ok_type = isinstance(value, self.kind) and not isinstance(value, bool)
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok_type = True
        if not ok_type:
            raise SpecConfigError(
                f"{key} must be {self.kind.__name__}, got {type(value).__name__} {value!r}",
                key=key,
            )
        if self.choices and value not in self.choices:
            raise SpecConfigError(
                f"{key} = {value!r} is unknown; allowed: {', '.join(self.choices)}",
                key=key,
            )
        if self.low is None or self.high is None:
            return
        number = float(value)  # type: ignore[arg-type]
        if not self.low <= number <= self.high:
            raise SpecConfigError(
                f"{key} = {value!r} is out of range; allowed {_fmt(self.low)}..{_fmt(self.high)}",
                key=key,
            )


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


RULES: dict[str, Rule] = {
    "strategy": Rule(str, help="how drafts are proposed", choices=STRATEGIES),
    "window_min_tokens": Rule(int, 0, 64, "fewest drafted tokens in a speculative window"),
    "window_max_tokens": Rule(int, 0, 64, "most drafted tokens in a window"),
    "max_pipeline_depth": Rule(int, 1, 8, "most verify windows in flight"),
    "ngram_min": Rule(int, 1, 16, "shortest n-gram context matched"),
    "ngram_max": Rule(int, 1, 16, "longest n-gram context matched"),
    "ngram_cache_min_hits": Rule(int, 1, 1_000_000, "ngram-cache: least count to propose"),
    "mtp_depth": Rule(int, 0, 8, "tokens drafted by the MTP heads"),
    "extension_tokens": Rule(int, 0, 64, "n-gram tokens after the MTP prefix"),
    "ewma_alpha": Rule(float, 0.001, 1.0, "weight of the newest acceptance sample"),
    "prior_acceptance": Rule(float, 0.0, 0.99, "acceptance assumed before measuring"),
    "min_speedup": Rule(float, 1.0, 100.0, "least predicted speedup to speculate"),
    "draft_model": Rule(str, help="draft model checkpoint (dir or .gguf) for draft strategies"),
    "draft_ahead_tokens": Rule(int, 0, 64, "draft choices computed while a window is out"),
    "draft_vocab_tokens": Rule(
        int, 0, 1 << 24, "draft scores its first N ids and the request's own (0 = all)"
    ),
}

KEYS: tuple[str, ...] = tuple(RULES)


def resolve_spec_config(
    model_defaults: Mapping[str, Any],
    file: Mapping[str, Any],
    cli: Mapping[str, Any],
    request: Mapping[str, Any],
) -> SpecConfig:
    """Merge the four levels (request > CLI > config file > model defaults) into a `SpecConfig`.

    Each mapping holds only the keys explicitly set at that level. An unknown key, a mistyped
    value or an out-of-range value raises `SpecConfigError` naming the key and the level.
    """
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for level, values in zip(LEVELS, (model_defaults, file, cli, request), strict=True):
        for key, value in values.items():
            if level == "request" and key in NODE_ONLY_KEYS:
                raise SpecConfigError(
                    f"{key} is the node's setting (spec.{key}, "
                    f"{flag_name(key)}); a request cannot set it",
                    key=key,
                    level=level,
                )
            if key not in RULES:
                raise SpecConfigError(
                    f"speculative config: unknown key {key!r} in {level}; "
                    f"known keys: {', '.join(KEYS)}",
                    key=str(key),
                    level=level,
                )
            try:
                RULES[key].check(key, value)
            except SpecConfigError as err:
                raise SpecConfigError(
                    f"speculative config: {err} (set in {level})", key=key, level=level
                ) from None
            merged[key] = float(value) if RULES[key].kind is float else value
            origin[key] = level
    try:
        return SpecConfig(**merged)
    except SpecConfigError as err:
        # Cross-field checks: blame the highest level that set either side.
        level = origin.get(err.key, "built-in default")
        raise SpecConfigError(
            f"speculative config: {err} (set in {level})", key=err.key, level=level
        ) from None


def flag_name(key: str) -> str:
    """The CLI flag for a config key: `window_max_tokens` → `--speculative-window-max-tokens`."""
    if key not in RULES:
        raise SpecConfigError(f"speculative config: unknown key {key!r}", key=key)
    return "--speculative-" + key.replace("_", "-")


def _dest(key: str) -> str:
    return "speculative_" + key


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one `--speculative-*` flag per key; unset flags stay absent from the namespace."""
    group = parser.add_argument_group("speculative decoding")
    defaults = SpecConfig()
    for key, rule in RULES.items():
        default = getattr(defaults, key)
        kwargs: dict[str, Any] = {
            "dest": _dest(key),
            "type": rule.kind,
            "default": argparse.SUPPRESS,
            "help": f"{rule.help} (default {default if default != '' else 'none'})",
        }
        if rule.choices:
            kwargs["choices"] = rule.choices
        group.add_argument(flag_name(key), **kwargs)


def spec_cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The keys set on the command line (after `add_spec_arguments`), for `resolve_spec_config`."""
    return {key: getattr(args, _dest(key)) for key in RULES if hasattr(args, _dest(key))}
