"""Draft-model speculation: a small model of the target's family drafts on the coordinator.

`DraftModel` is a whole checkpoint (any the runtime loads) held once per coordinator node as a
`StageModel` of all its layers; each request drafts in a session of its own there, with its
own positional KV cache. `DraftProposer` (`draft`) keeps that cache in step with the tokens it
has seen: it remembers which tokens its cache holds, and before drafting it writes only the
part of the context that differs from them, at its position. After a rejection the cache is
therefore rewritten from the rollback position (KV is positional: nothing is undone), and after
an accepted window only the bonus token is new. It then drafts k tokens one at a time.

`DraftNgram` (`draft-ngram`) drafts the model's first token and, where prompt lookup's copy
starts with that token, proposes the copy instead of the model's further tokens (the model
agrees that the text is copying; a confirmed copy is right more often than a small model, and
costs no further draft passes), as the MTP hybrids do.

Exactness does not depend on the draft: verification accepts only the target's own choice at
each position (see `sampling.verify`), so greedy and seeded sampled output equal `disabled`'s.

The coordinator times each proposal; the seconds per draft-model pass (`draft_cost_s`) enter
the window policy's cost model (`LinkModel.draft_per_token_s`: a model-drafted token is one
pass), so the width adapts to what a draft token costs against what the route's round trip
costs. A pass costs the same whatever it proposes: a window of prompt lookup's copy after one
pass is that one pass, so the cost is per pass, not per proposed token.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from meshd.speculative.config import SpecConfig
from meshd.speculative.draft_vocab import DraftVocab
from meshd.speculative.ngram import NgramSimple
from meshd.speculative.proposer import AccountedProposer
from meshd.speculative.sampling import SamplingParams, coupled_draft_token, coupled_draft_tokens

if TYPE_CHECKING:
    from meshd.model.stage import StageModel

# Weight of the newest proposal in the draft's seconds-per-token estimate.
_COST_EWMA = 0.2
# Positions a draft session holds beyond what it needs now (reopened, doubled, when outgrown).
# A pass writing at least this many tokens times what a written token costs (a prefill's rate).
_LONG_PASS = 16
_SESSION_SLACK = 256

_session_ids = itertools.count()


class DraftMismatchError(ValueError):
    """The draft's tokenizer is not the target's (nor a prefix of its vocabulary)."""


def check_draft_tokenizer(target: str | os.PathLike[str], draft: str | os.PathLike[str]) -> None:
    """Raise `DraftMismatchError` (naming both) unless the draft's tokenizer is the target's.

    Same means: every draft token has the same id in the target's vocabulary and the draft's
    ids are the target's first ids (a vocabulary that is a prefix of the target's is allowed:
    the target's extra ids are tokens the draft never proposes).
    """
    from meshd.model.files import model_name, open_tokenizer

    target_vocab = open_tokenizer(target).vocabulary()
    draft_vocab = open_tokenizer(draft).vocabulary()
    names = f"draft {model_name(draft)} ({draft}), target {model_name(target)} ({target})"
    if len(draft_vocab) > len(target_vocab):
        raise DraftMismatchError(
            f"draft model's tokenizer differs from the target's: {names}: the draft has "
            f"{len(draft_vocab)} tokens, the target {len(target_vocab)}"
        )
    for token, index in draft_vocab.items():
        if target_vocab.get(token) != index:
            raise DraftMismatchError(
                f"draft model's tokenizer differs from the target's: {names}: draft token "
                f"{token!r} is id {index}, in the target "
                f"{target_vocab.get(token, 'absent')}"
            )


class DraftModel:
    """A whole draft checkpoint for the coordinator: sessions, forward passes, its vocabulary.

    Not thread-safe: the coordinator calls it from one window-loop step at a time
    (`Coordinator._step`).
    """

    def __init__(
        self,
        stage: StageModel,
        path: str,
        eos_ids: Sequence[int] = (),
        prefix_cache_bytes: int | None = None,
    ) -> None:
        """`prefix_cache_bytes`: what the KV kept from finished requests may hold (None: the
        stage's own setting, 0 unless set)."""
        self.stage = stage
        self.path = path
        self.vocab_size = stage.config.vocab_size
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        if prefix_cache_bytes is not None:
            stage.kv.cache_limit_bytes = prefix_cache_bytes
        # The tokens each kept entry's KV holds, least recently used first (the KV cache may
        # have evicted an entry since: opening from it then reuses nothing).
        self._kept: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._entry_ids = itertools.count(1)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.float32,
        quantization: str = "none",
        prefix_cache_bytes: int = 0,
    ) -> DraftModel:
        """Load every layer of the checkpoint at `path` on the CPU (the coordinator's device).

        `quantization` as the node's ("q8_0", "gguf", ...; "none" keeps `dtype`);
        `prefix_cache_bytes` as the node's `stage.prefix_cache_bytes` (0: keep none).
        """
        from meshd.model.errors import MissingFile
        from meshd.model.files import open_checkpoint, open_tokenizer
        from meshd.model.stage import StageModel

        checkpoint = open_checkpoint(path)
        if quantization == "gguf" and checkpoint.default_quantization != "gguf":
            # A draft of another format beside a GGUF target runs at its own precision: its
            # tokens are proposals the target verifies, so they need not match any peer's.
            quantization = checkpoint.default_quantization
        stage = StageModel.load(
            checkpoint,
            0,
            checkpoint.config.num_layers,
            device="cpu",
            dtype=dtype,
            quantization=quantization,
        )
        # It keeps the governor a stage gets (`ThreadGovernor`): on cores other work holds, a
        # pass on every thread runs many times slower than on one, for a draft as for a
        # stage. Torch's thread count is the calling thread's, and a governed stage sets its
        # own before each pass, so the draft's choice (on the coordinator's thread) and a
        # stage's (on its worker thread) do not touch each other.
        try:
            eos_ids: Sequence[int] = open_tokenizer(path).eos_ids
        except MissingFile:  # a bare checkpoint (tests): it drafts through EOS, harmlessly
            eos_ids = ()
        return cls(stage, str(path), eos_ids, prefix_cache_bytes)

    @property
    def sessions(self) -> int:
        """Draft sessions open now (one per request drafting with it), from its KV's table."""
        return len(self.stage.kv)

    @property
    def kv_used_bytes(self) -> int:
        """KV cache bytes its open sessions hold (0 once every request closed its session)."""
        return self.stage.kv.used_bytes

    @property
    def cache_bytes(self) -> int:
        """KV bytes kept from finished requests for later ones (`stage.prefix_cache_bytes`)."""
        return self.stage.kv.cache_bytes

    def open(self, max_positions: int) -> str:
        """A new session holding up to `max_positions` positions; its id."""
        session = f"draft-{next(_session_ids)}"
        self.stage.open_session(session, max_positions)
        return session

    def resume(self, max_positions: int, log: Sequence[int]) -> tuple[str, int]:
        """A new session holding up to `max_positions` positions: `(its id, p)`, its first p
        positions already holding the KV of `log[:p]`, copied from the kept entry that
        shares the longest prefix with `log` (a chat's next turn starts with the last one).
        """
        best, shared = self._best_entry(log)
        shared = min(shared, max_positions)
        if shared <= 0:
            return self.open(max_positions), 0
        session = f"draft-{next(_session_ids)}"
        self._kept.move_to_end(best)
        return session, self.stage.open_session(session, max_positions, prefix=(best, shared))

    def kept_prefix(self, log: Sequence[int]) -> int:
        """How many leading tokens of `log` a session opened now would hold already."""
        return self._best_entry(log)[1]

    def _best_entry(self, log: Sequence[int]) -> tuple[int, int]:
        """The kept entry sharing the longest prefix with `log`, and how much of it is reused:
        at most `len(log) - 1` (the row after the last token comes from a pass writing it)."""
        best, shared = 0, 0
        for entry, tokens in self._kept.items():
            common = min(_common_prefix(tokens, log), self.stage.kv.entry_positions(entry))
            if common > shared:
                best, shared = entry, common
        return best, min(shared, len(log) - 1)

    def close(self, session: str, holds: Sequence[int] = ()) -> None:
        """Free a session's KV (no-op when it is not open); `holds`, the tokens whose KV it
        holds from position 0, are kept as an entry for a later request that starts with
        them (within the cache's bytes; the oldest entries give way)."""
        if holds and session in self.stage.kv:
            kv, held = self.stage.kv, tuple(holds)
            # An entry this one extends (the chat's previous turn) is no use beside it.
            kv.drop_entries([e for e, t in self._kept.items() if held[: len(t)] == t], b"")
            entry = next(self._entry_ids)
            if kv.keep(session, entry, len(held)):
                self._kept[entry] = held
            for gone in [e for e in self._kept if kv.entry_positions(e) == 0]:
                del self._kept[gone]  # dropped, or evicted by the cache to make room
        self.stage.close_session(session)

    def vocab(self, first: int, log: Sequence[int]) -> DraftVocab | None:
        """The ids a request's passes score: the first `first`, the EOS ids and the ids of
        `log` (None: the whole vocabulary; `DraftVocab.narrowing`)."""
        return DraftVocab.narrowing(self.stage.head, first, [*self.eos_ids, *log])

    def scored_rows(self, first: int) -> int:
        """The head rows a pass multiplies by under `spec.draft_vocab_tokens = first`, before
        a request adds its own ids."""
        vocab = self.vocab(first, ())
        return self.vocab_size if vocab is None else len(vocab.ids)

    def next_logits(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        """Write `tokens` at `base_pos..` and return the logits row after the last of them.

        Target ids past the draft's vocabulary (a prefix vocabulary) are fed as id 0: they are
        the target's added tokens, which the draft never learnt.
        """
        return self.rows(session, base_pos, tokens, 1, vocab)[-1]

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        """Write `tokens` at `base_pos..` and return the logits rows after each of the last
        `last_n` of them (`[last_n, V]`; with `vocab`, a column per id of `vocab.ids`)."""
        ids = torch.tensor([t if t < self.vocab_size else 0 for t in tokens], dtype=torch.long)
        head = None if vocab is None else vocab.matrix()
        out = self.stage.forward(session, base_pos, ids, logits_last_n=last_n, head=head)
        assert out.logits is not None  # the whole model: its last layer is here
        return out.logits


class DraftProposer(AccountedProposer):
    """`draft`: k tokens from the draft model, its KV cache kept in step with the log."""

    name = "draft"

    def __init__(
        self, config: SpecConfig, draft: DraftModel, sampling: SamplingParams | None = None
    ) -> None:
        super().__init__(config)
        self.draft = draft
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.tokens: list[int] = []
        self.vocab: DraftVocab | None = None  # the ids its passes score (None: all)
        self._session: str | None = None
        self._capacity = 0
        self._cached: list[int] = []  # the tokens whose KV the session holds, from position 0
        # The draft's choice at position p, made from the logits after `_cached[:p]`: valid
        # while those tokens stay cached, so a later proposal along the same tokens (after a
        # pass run ahead while a window was in flight) needs no pass for it.
        self._choices: dict[int, int] = {}
        self.ahead_s = 0.0  # this request's passes run ahead (off the window's critical path)
        self._cost_s: float | None = None
        self._catch_up_s = 0.0  # the current proposal's catch-up pass's seconds (else 0)
        self._recalled = 0  # the current proposal's choices recalled from earlier passes
        # The latest `predict_log` pass's seconds (None after one that wrote the whole log,
        # the prompt's prefill included, or that was its session's first, which a kept
        # prefix spared the prefill: not what a pass over new tokens costs).
        self.last_score_s: float | None = None
        self._opened = False  # a session opened and no scoring pass has run in it yet
        # Seconds per token a long pass writes (EWMA over passes of `_LONG_PASS` tokens or
        # more: a prefill or a catch-up; None until one was timed).
        self.write_token_s: float | None = None
        self.last_draft_s = 0.0  # the latest proposal's time (the window loop nets it out)
        self.draft_s = 0.0  # this request's drafting time in all
        self.passes = 0  # draft forward passes of this request
        self.clock: Callable[[], float] = time.perf_counter  # times its passes

    @property
    def draft_cost_s(self) -> float:
        """Measured seconds per draft-model pass, the cost of each token the model drafts (0
        until something was drafted)."""
        return self._cost_s or 0.0

    @property
    def runs_a_model(self) -> bool:
        return True

    def reset(self, prompt: Sequence[int]) -> None:
        """New request: a fresh draft session (opened when first needed), `prompt` as the log."""
        self._clear_stats()
        self.close()
        self.tokens = [int(t) for t in prompt]
        self.vocab = self.draft.vocab(self.config.draft_vocab_tokens, self.tokens)
        self.draft_s = 0.0
        self.ahead_s = 0.0
        self.passes = 0
        self.last_draft_s = 0.0

    def close(self) -> None:
        """Free the draft session (the request ended), its KV kept for a later request that
        starts with the same tokens (`DraftModel.close`)."""
        if self._session is not None:
            self.draft.close(self._session, self._cached)
        self._session = None
        self._capacity = 0
        self._cached = []
        self._choices = {}

    def observe(self, committed: Sequence[int]) -> None:
        """Append committed tokens (the cache catches up when it next drafts)."""
        new = [int(t) for t in committed]
        self.tokens.extend(new)
        if self.vocab is not None:
            self.vocab.see(new)

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        """Drafts after the log (`mtp_draft` is ignored)."""
        return self.propose_after((), max_tokens)

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts after the log plus `assumed`."""
        self.last_draft_s = 0.0
        if max_tokens <= 0:
            return []
        started = self.clock()
        self._catch_up_s = 0.0
        self._recalled = 0
        passes = self.passes
        drafts = self._draft([*self.tokens, *(int(t) for t in assumed)], max_tokens)
        spent = self.clock() - started
        self.last_draft_s = spent
        self.last_recalled = self._recalled
        self.draft_s += spent
        # The cost is per drafting pass, whatever the pass proposed (a copy after one pass is
        # one pass), as the window waits for it: a choice recalled from a pass run ahead is a
        # pass the window did not wait for, counted at no time. A pass that caught up on the
        # log (the prompt's prefill, or the tokens committed while another strategy drafted)
        # is the price of starting, once: it is left out, time and pass.
        caught_up = 1 if self._catch_up_s > 0 else 0
        self._charge(spent - self._catch_up_s, self.passes - passes - caught_up + self._recalled)
        return drafts

    def think_ahead(self, assumed: Sequence[int], max_tokens: int) -> bool:
        """One pass of the draft's chain after the log plus `assumed` (a window in flight,
        assumed accepted), toward `max_tokens` choices beyond it: the guess of the window's
        bonus token and the next window's drafts. False when there is nothing to do (the
        chain is known that far, or ends in an EOS), so the caller stops asking.

        The driver runs it while the window is in flight, when the coordinator would
        otherwise wait: a reply that confirms the chain finds its next proposal already
        drafted (`_choices`), one that breaks it still finds the window's last draft
        written, so its next proposal writes one token, not two.
        """
        full = [*self.tokens, *(int(t) for t in assumed)]
        if not full:
            return False
        ahead = 0
        while ahead < max_tokens:
            token = self._recall(full)
            if token is None:
                break
            if token in self.draft.eos_ids:
                return False
            full.append(token)
            ahead += 1
        if ahead >= max_tokens:
            return False
        self._ensure_session(len(full) + 1)
        started = self.clock()
        self._pass(full)
        self.ahead_s += self.clock() - started
        return True

    def predict_log(self, since: int) -> tuple[int, list[int]]:
        """The draft's own choice at each position of the log from `since` on and one past
        its end, teacher-forced: `(first, tokens)`, `tokens[j]` the draft token for position
        `first + j` given the log before it (`first` is `since` clamped to 1..len(log)).

        One pass writes the log tokens the cache does not hold yet (at least the last): the
        draft would write them anyway before its next proposal, so scoring the draft while
        it is not drafting costs a pass over the new tokens, not a pass per drafted token.
        A draft chain that has been right so far drafts from the log itself, so these choices
        settle exactly how many tokens a proposal started at any of those positions would
        have had accepted (`auto` scores the draft with them).
        """
        context = self.tokens
        if not context:
            return 1, []
        since = max(1, min(since, len(context)))
        self._ensure_session(len(context) + 1)
        cached = self._cached
        same = _common_prefix(cached, context)
        # The row for position `since` needs the token before it written in this pass.
        same = max(0, min(same, len(context) - 1, since - 1))
        feed = context[same:]
        del self._cached[same:]  # overwritten from here, by this pass or half by a failed one
        started = self.clock()
        rows = self.draft.rows(self._session_id(), same, feed, len(context) - since + 1, self.vocab)
        spent = self.clock() - started
        self.last_score_s = None if same == 0 or self._opened else spent
        self._opened = False
        self._time_writes(spent, len(feed))
        self.passes += 1
        self._keep(same, feed)
        columns = None if self.vocab is None else self.vocab.ids
        return since, coupled_draft_tokens(rows, self.sampling, since, columns)

    def unwritten(self) -> int:
        """Log tokens the draft's cache does not hold (what its next pass must write; before
        its session opens, what the kept entry it would start from leaves)."""
        if self._session is None:
            return len(self.tokens) - max(0, self.draft.kept_prefix(self.tokens))
        return len(self.tokens) - _common_prefix(self._cached, self.tokens)

    def _time_writes(self, seconds: float, written: int) -> None:
        """Fold a long pass's seconds per written token into `write_token_s`."""
        if written >= _LONG_PASS:
            per_token = seconds / written
            old = self.write_token_s
            self.write_token_s = per_token if old is None else old + _COST_EWMA * (per_token - old)

    def _charge(self, seconds: float, passes: int) -> None:
        """Fold `seconds` over `passes` drafting passes into the per-pass drafting cost."""
        if passes > 0:
            per_token = seconds / passes
            old = self._cost_s
            self._cost_s = per_token if old is None else old + _COST_EWMA * (per_token - old)

    def _agreeing_copy(self, context: list[int], first: int, max_tokens: int) -> list[int]:
        """A copy to propose instead of further model drafts (`draft-ngram`); none here."""
        return []

    def _draft(self, context: list[int], count: int) -> list[int]:
        """`count` tokens after `context` (fewer after an EOS or an agreeing copy)."""
        if not context:
            return []  # nothing to condition on
        self._ensure_session(len(context) + count)
        full = list(context)
        out: list[int] = []
        while len(out) < count:
            token = self._recall(full)
            if token is None:
                token = self._pass(full)
            else:
                self._recalled += 1
            out.append(token)
            if token in self.draft.eos_ids:
                break  # nothing after an EOS is accepted
            if len(out) == 1:
                copy = self._agreeing_copy(context, token, count)
                if copy:
                    return copy
            full.append(token)
        return out

    def _recall(self, full: list[int]) -> int | None:
        """The draft's choice after `full` from an earlier pass, if the cache still holds
        exactly the tokens it was made from (else None)."""
        position = len(full)
        token = self._choices.get(position)
        if token is None or len(self._cached) < position:
            return None
        return token if self._cached[:position] == full else None

    def _pass(self, full: list[int]) -> int:
        """One pass writing what the cache lacks of `full` (at least its last token, whose
        logits choose the next): the draft's choice after `full`."""
        cached = self._cached
        # Reuse the longest common prefix, but always write the last token: its logits are
        # the choice's.
        same = min(_common_prefix(cached, full), len(full) - 1)
        feed = full[same:]
        del self._cached[same:]  # overwritten from here, by this pass or half by a failed one
        # More tokens than a window commits (its drafts and the bonus): a catch-up pass.
        catch_up = len(feed) > self.config.window_max_tokens + 1
        started = self.clock() if catch_up else 0.0
        row = self.draft.next_logits(self._session_id(), same, feed, self.vocab)
        if catch_up:
            elapsed = self.clock() - started
            self._catch_up_s += elapsed
            self._time_writes(elapsed, len(feed))
        self.passes += 1
        self._keep(same, feed)
        token = self._choose(row, len(full))
        self._choices[len(full)] = token
        return token

    def _keep(self, start: int, written: list[int]) -> None:
        """The cache now holds `written` from position `start` (what followed is gone, and
        with it every choice made after it)."""
        del self._cached[start:]
        self._cached.extend(written)
        self._choices = {p: t for p, t in self._choices.items() if p <= start}

    def _choose(self, row: torch.Tensor, position: int) -> int:
        """The draft token for absolute `position` from the draft's logits row.

        Greedy requests take the draft's argmax; sampled ones draw with the target's own keyed
        noise (Gumbel-max coupling, `coupled_draft_token`), so the draft predicts the target's
        sample whenever its distribution is close. Verification accepts only the target's
        choice either way.
        """
        columns = None if self.vocab is None else self.vocab.ids
        return coupled_draft_token(row, self.sampling, position, columns)

    def _ensure_session(self, needed: int) -> None:
        if self._session is not None and needed <= self._capacity:
            return
        self.close()  # an outgrown session's KV is kept, and the larger one starts from it
        self._capacity = max(2 * needed, needed + _SESSION_SLACK)
        self._session, reused = self.draft.resume(self._capacity, self.tokens)
        self._cached = self.tokens[:reused]
        self._opened = True

    def _session_id(self) -> str:
        assert self._session is not None
        return self._session


class DraftNgram(DraftProposer):
    """`draft-ngram`: prompt lookup's copy where it starts with the draft's first token, else
    the draft model's tokens."""

    name = "draft-ngram"

    def __init__(
        self, config: SpecConfig, draft: DraftModel, sampling: SamplingParams | None = None
    ) -> None:
        super().__init__(config, draft, sampling)
        self.ngram = NgramSimple(config)
        self.copies = 0  # windows of this request that proposed the n-gram's copy

    def reset(self, prompt: Sequence[int]) -> None:
        """New request: the draft session and the n-gram index start anew."""
        super().reset(prompt)
        self.ngram.reset(prompt)
        self.copies = 0

    def observe(self, committed: Sequence[int]) -> None:
        """Feed both the draft's log and the n-gram index."""
        super().observe(committed)
        self.ngram.observe(committed)

    def _agreeing_copy(self, context: list[int], first: int, max_tokens: int) -> list[int]:
        assumed = context[len(self.tokens) :]
        copy = self.ngram.propose_after(assumed, max_tokens)
        if copy and copy[0] == first:
            self.copies += 1
            return copy
        return []


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (the draft cache's reusable positions)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
