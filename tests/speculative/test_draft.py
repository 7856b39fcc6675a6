"""The draft-model strategies: exact output, a KV cache kept in step, the tokenizer rule."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import tokenizers
import torch

from meshd.model.builtin import builtin_draft_dir, builtin_model_dir
from meshd.speculative.config import (
    DRAFT_STRATEGIES,
    SpecConfig,
    SpecConfigError,
    resolve_spec_config,
)
from meshd.speculative.draft import (
    DraftMismatchError,
    DraftModel,
    DraftNgram,
    DraftProposer,
    check_draft_tokenizer,
)
from meshd.speculative.draft_vocab import DraftVocab
from meshd.speculative.policy import LinkModel, PolicyInputs, choose
from meshd.speculative.sampling import SamplingParams
from meshd.speculative.strategies import make_proposer
from tests.speculative.drafts import tiny_draft, tiny_draft_dir
from tests.speculative.target import VOCAB, Target, decode_pipelined, decode_plain, decode_spec

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
PARAMS = {
    "greedy": SamplingParams(),
    "t08": SamplingParams(temperature=0.8, seed=99),
}


def config(strategy: str = "draft", **extra: object) -> SpecConfig:
    return SpecConfig(
        strategy=strategy,
        window_max_tokens=6,
        ngram_min=1,
        ngram_max=3,
        draft_model=str(tiny_draft_dir(VOCAB)),
        **extra,  # type: ignore[arg-type]
    )


def fresh_logits(draft: DraftModel, context: list[int]) -> torch.Tensor:
    """The draft's next-token logits after `context`, from a session of its own."""
    session = draft.open(len(context) + 8)
    try:
        return draft.next_logits(session, 0, context)
    finally:
        draft.close(session)


class _Timed:
    """The draft `model` on a virtual clock `now[0]`: a pass costs 1 ms, or 1 ms per token it
    writes (`per_token`)."""

    def __init__(self, model: DraftModel, now: list[float], per_token: bool) -> None:
        self.model, self.now, self.per_token = model, now, per_token

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)

    def next_logits(
        self, session: str, base_pos: int, tokens: list[int], vocab: DraftVocab | None = None
    ) -> torch.Tensor:
        self.now[0] += 0.001 * (len(tokens) if self.per_token else 1)
        return self.model.next_logits(session, base_pos, tokens, vocab)


def _timed(model: DraftModel, now: list[float], per_token: bool = False) -> _Timed:
    return _Timed(model, now, per_token)


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("strategy", DRAFT_STRATEGIES)
def test_draft_strategies_commit_exactly_the_plain_tokens(strategy: str, mode: str) -> None:
    params = PARAMS[mode]
    for target_seed in (1, 2):
        target = Target(target_seed)
        plain = decode_plain(target, PROMPT, 48, params)
        proposer = make_proposer(
            strategy, config(strategy), draft=tiny_draft(VOCAB), sampling=params
        )
        run = decode_spec(target, PROMPT, 48, params, proposer, 6)
        assert run.tokens == plain
        pipelined = make_proposer(
            strategy, config(strategy), draft=tiny_draft(VOCAB), sampling=params
        )
        assert decode_pipelined(target, PROMPT, 48, params, pipelined, 3).tokens == plain
        proposer.close()
        pipelined.close()


def test_the_draft_cache_stays_in_step_after_rejections() -> None:
    # A random draft against an unrelated target: most windows are rejected part-way, so the
    # draft's cache holds drafts the log contradicts and must be rewritten from there.
    draft = tiny_draft(VOCAB)
    target = Target(3)
    params = PARAMS["greedy"]
    proposer = DraftProposer(config(), draft)
    run = decode_spec(target, PROMPT, 40, params, proposer, 5)
    assert run.drafted - run.accepted >= 5  # rejections happened
    log = [*PROMPT, *run.tokens]
    # Its next proposal comes from the cache it kept; a fresh session over the whole log
    # must give the same first draft and the same logits.
    passes = proposer.passes
    first = proposer.propose(1)
    assert proposer.passes == passes + 1  # it wrote only what the cache lacked, in one pass
    assert first == [int(torch.argmax(fresh_logits(draft, log)))]
    session = proposer._session
    assert session is not None
    kept = draft.next_logits(session, len(log) - 1, log[-1:])
    torch.testing.assert_close(kept, fresh_logits(draft, log), rtol=1e-4, atol=1e-4)
    proposer.close()


def test_after_an_accepted_window_only_the_new_tokens_are_written() -> None:
    draft = tiny_draft(VOCAB)
    proposer = DraftProposer(config(), draft)
    proposer.reset(PROMPT)
    drafts = proposer.propose(4)
    assert proposer._cached == [*PROMPT, *drafts[:-1]]
    proposer.observe([*drafts[:2], 7])  # two accepted, then the target's own token
    proposer.propose(1)
    assert proposer._cached == [*PROMPT, *drafts[:2], 7]
    proposer.close()


def test_draft_ngram_proposes_an_agreeing_copy_else_the_models_drafts() -> None:
    draft = tiny_draft(VOCAB)
    model = DraftProposer(config(), draft)
    hybrid = DraftNgram(config("draft-ngram"), draft)
    agreeing = disagreeing = 0
    # History whose suffix (11, 12) was once followed by t, 20, 21, 22, 23: prompt lookup
    # copies that. The hybrid proposes the copy exactly when the model's own first draft is t.
    for t in range(VOCAB):
        if t in (11, 12):
            continue
        history = [*PROMPT, 11, 12, t, 20, 21, 22, 23, 11, 12]
        model.reset(history)
        own = model.propose(5)
        hybrid.reset(history)
        proposed = hybrid.propose(5)
        if own[0] == t:
            agreeing += 1
            assert proposed == [t, 20, 21, 22, 23] and hybrid.copies == 1
        else:
            disagreeing += 1
            assert proposed == own and hybrid.copies == 0
    assert agreeing >= 1 and disagreeing >= 1
    model.close()
    hybrid.close()


def test_draft_cost_is_measured_and_enters_the_policy() -> None:
    proposer = DraftProposer(config(), tiny_draft(VOCAB))
    proposer.reset(PROMPT)
    proposer.propose(4)
    assert proposer.draft_cost_s > 0 and proposer.last_draft_s > 0
    link = LinkModel(rtt_s=0.02, pass_fixed_s=0.004, pass_per_token_s=0.0005, stages=2)
    alphas = (0.7,)
    cheap = choose(PolicyInputs(link, alphas), SpecConfig(window_max_tokens=8))
    dear = choose(
        PolicyInputs(link.with_draft_cost(0.004), alphas), SpecConfig(window_max_tokens=8)
    )
    # A draft token that costs a fifth of the round trip makes deep windows a bad bet.
    assert 0 < dear.width < cheap.width
    assert dear.expected_s_per_token > cheap.expected_s_per_token
    proposer.close()


def test_draft_strategies_need_a_draft_model_and_requests_cannot_name_one() -> None:
    with pytest.raises(SpecConfigError, match="needs a draft model") as err:
        resolve_spec_config({}, {}, {}, {"strategy": "draft"})
    assert err.value.key == "strategy" and err.value.level == "request"
    node = {"draft_model": "/models/draft"}
    assert resolve_spec_config({}, node, {}, {"strategy": "draft"}).strategy == "draft"
    with pytest.raises(SpecConfigError, match="the node's setting") as err:
        resolve_spec_config({}, node, {}, {"draft_model": "/elsewhere"})
    assert err.value.key == "draft_model" and err.value.level == "request"


def _save_tokenizer(source: pathlib.Path, out: pathlib.Path, extra: list[str]) -> pathlib.Path:
    out.mkdir()
    backend = tokenizers.Tokenizer.from_file(str(source / "tokenizer.json"))
    backend.add_tokens(extra)
    backend.save(str(out / "tokenizer.json"))
    shutil.copy(source / "tokenizer_config.json", out)
    return out


def other_tokenizer(directory: pathlib.Path) -> pathlib.Path:
    """A directory holding a small BPE tokenizer of its own (not the built-in model's)."""
    directory.mkdir()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"])
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x * 2\n"] * 20, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_a_draft_tokenizer_must_be_the_targets_or_a_prefix(tmp_path: pathlib.Path) -> None:
    builtin = builtin_model_dir()
    check_draft_tokenizer(builtin, builtin_draft_dir())
    longer = _save_tokenizer(builtin, tmp_path / "target-plus", ["<|tool|>"])
    check_draft_tokenizer(longer, builtin_draft_dir())  # the draft's vocabulary is a prefix
    with pytest.raises(DraftMismatchError) as err:
        check_draft_tokenizer(builtin, longer)
    assert "target-plus" in str(err.value) and "builtin" in str(err.value)
    other = other_tokenizer(tmp_path / "other")
    with pytest.raises(DraftMismatchError, match="differs") as err:
        check_draft_tokenizer(builtin, other)
    assert str(other) in str(err.value) and str(builtin) in str(err.value)


class _Builtin:
    """The built-in model as the target of `decode_spec`: window rows from a fresh session."""

    def __init__(self, stage: object) -> None:
        self.stage = stage

    def window_logits(self, context: list[int], window: list[int]) -> torch.Tensor:
        from meshd.model.stage import StageModel

        stage = self.stage
        assert isinstance(stage, StageModel)
        stage.open_session("target", len(context) + len(window) + 1)
        try:
            tokens = torch.tensor([*context, *window])
            out = stage.forward("target", 0, tokens, logits_last_n=len(window))
            assert out.logits is not None
            return out.logits
        finally:
            stage.close_session("target")


def test_a_sampled_request_drafts_the_targets_own_sample() -> None:
    # Drafting with the target's keyed noise: a draft as good as the target predicts its
    # sample every time, where an argmax draft is right only when the sample is the argmax.
    target = DraftModel.load(builtin_model_dir())  # the target as its own draft: q = p
    params = SamplingParams(temperature=1.0, seed=7)
    prompt = [int(t) for t in torch.arange(40, 52)]
    rates = {}
    with torch.inference_mode():
        for name in ("coupled", "argmax"):
            proposer = DraftProposer(config(), target, sampling=params)
            if name == "argmax":  # the comparison: what drafting without the noise accepts
                proposer._choose = lambda row, position: int(torch.argmax(row))  # type: ignore[method-assign]
            run = decode_spec(_Builtin(target.stage), prompt, 40, params, proposer, 4)  # type: ignore[arg-type]
            rates[name] = run.accepted / run.drafted
            proposer.close()
    assert rates["coupled"] > 0.95, rates
    assert rates["argmax"] < rates["coupled"] - 0.2, rates


def test_the_shipped_draft_fits_in_three_megabytes_and_loads_as_a_draft() -> None:
    """Issue 23's limit for the built-in model's draft, tokenizer included: it ships in the
    package, and a bigger one is a download in disguise."""
    files = list(builtin_draft_dir().iterdir())
    assert sum(f.stat().st_size for f in files) <= 3_000_000
    from meshd.model.files import open_checkpoint

    draft = DraftModel.load(builtin_draft_dir())
    assert draft.vocab_size == open_checkpoint(builtin_model_dir()).config.vocab_size


def test_the_cost_per_drafted_token_leaves_out_the_pass_that_catches_up_on_the_prompt() -> None:
    # A virtual clock on which a pass costs 1 ms per token it writes: the prompt's prefill
    # (~100 tokens) is the draft's price of starting, not of each of its 4 drafted tokens.
    model = tiny_draft(VOCAB)
    now = [0.0]

    proposer = DraftProposer(config(), model)
    proposer.draft = _timed(model, now, per_token=True)  # type: ignore[assignment]
    proposer.clock = lambda: now[0]
    proposer.reset(PROMPT * 5)
    proposer.propose(4)
    assert proposer.last_draft_s == pytest.approx(0.001 * (len(PROMPT) * 5 + 3))
    assert proposer.draft_cost_s == pytest.approx(0.001)
    proposer.observe([1, 2])  # a window's commit: caught up in the next drafting pass
    proposer.propose(4)
    assert proposer.draft_cost_s == pytest.approx(0.001, rel=0.5)
    proposer.close()


def test_the_draft_is_charged_per_model_pass_not_per_proposed_token() -> None:
    # A pass costs 1 ms whatever it proposes: a window of prompt lookup's copy after one pass
    # costs that pass, so its 5 tokens must not read as 0.2 ms each (the gate would take the
    # draft for cheap); the model's own drafts cost a pass each.
    model = tiny_draft(VOCAB)
    now = [0.0]

    costs: dict[str, list[float]] = {"copy": [], "model": []}
    for t in range(VOCAB):
        if t in (11, 12) or (costs["copy"] and len(costs["model"]) > 2):
            continue
        hybrid = DraftNgram(config("draft-ngram"), model)
        hybrid.draft = _timed(model, now)  # type: ignore[assignment]
        hybrid.clock = lambda: now[0]
        # Short enough that the first pass is no catch-up: it is charged.
        hybrid.reset([11, 12, t, 20, 21, 11, 12])
        proposed = hybrid.propose(5)
        kind = "copy" if hybrid.copies else "model"
        assert len(proposed) == 5  # the copy: t, 20, 21, 11, 12
        costs[kind].append(hybrid.draft_cost_s)
        hybrid.close()
    assert costs["copy"] and costs["model"], costs
    assert all(c == pytest.approx(0.001) for c in costs["copy"] + costs["model"]), costs


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("strategy", DRAFT_STRATEGIES)
def test_passes_run_ahead_while_a_window_is_out_change_no_token(strategy: str, mode: str) -> None:
    # The draft of the target itself: its guesses of each bonus token hold most of the time,
    # so most proposals are recalled from passes run ahead, and the text is still plain
    # decoding's, greedy and sampled.
    params = PARAMS[mode]
    model = tiny_draft(VOCAB)
    target = Target(1)
    plain = decode_plain(target, PROMPT, 48, params)
    for ahead in (1, 3):
        proposer = make_proposer(strategy, config(strategy), draft=model, sampling=params)
        assert isinstance(proposer, DraftProposer)
        run = decode_spec(target, PROMPT, 48, params, proposer, 2, ahead=ahead)
        assert run.tokens == plain
        assert proposer.ahead_s > 0
        proposer.close()


def test_a_confirmed_guess_leaves_the_next_window_no_pass_to_wait_for() -> None:
    model = tiny_draft(VOCAB)
    proposer = DraftProposer(config(), model)
    proposer.reset(PROMPT)
    drafts = proposer.propose(2)
    # In flight: two passes write the last draft, guess the bonus, and draft one token past it.
    assert proposer.think_ahead(drafts, 2)
    assert proposer.think_ahead(drafts, 2)
    assert not proposer.think_ahead(drafts, 2)  # that far is known: nothing left to do
    fresh = DraftProposer(config(), model)
    fresh.reset([*PROMPT, *drafts])
    guess, after = fresh.propose(2)
    # The reply accepts both drafts and its bonus token is the guess: the next proposal is
    # the one the passes ahead made, with no pass of its own.
    passes = proposer.passes
    proposer.observe([*drafts, guess])
    assert proposer.propose(1) == [after]
    assert proposer.passes == passes
    # A bonus token other than the guess: one pass writes it alone (the last draft's KV
    # is already written), and the proposal is a fresh session's.
    proposer.reset(PROMPT)
    drafts = proposer.propose(2)
    while proposer.think_ahead(drafts, 2):
        pass
    other = (guess + 1) % VOCAB
    proposer.observe([*drafts, other])
    passes, cached = proposer.passes, len(proposer._cached)
    fresh.reset([*PROMPT, *drafts, other])
    assert proposer.propose(2) == fresh.propose(2)
    assert proposer.passes == passes + 2
    assert cached == len(PROMPT) + len(drafts) + 1  # prompt, both drafts, the guess
    proposer.close()
    fresh.close()


def test_a_recalled_choice_is_charged_as_a_pass_the_window_did_not_wait_for() -> None:
    model = tiny_draft(VOCAB)
    now = [0.0]

    proposer = DraftProposer(config(), model)
    proposer.draft = _timed(model, now)  # type: ignore[assignment]
    proposer.clock = lambda: now[0]
    proposer.reset(PROMPT[:6])
    drafts = proposer.propose(1)
    assert proposer.draft_cost_s == pytest.approx(0.001)
    while proposer.think_ahead(drafts, 2):
        pass
    assert proposer.ahead_s == pytest.approx(0.002)
    guess = proposer._choices[len(PROMPT[:6]) + 1]
    proposer.observe([*drafts, guess])
    proposer.propose(1)  # recalled: no time, one pass's worth of drafting
    assert proposer.last_draft_s == 0
    assert proposer.draft_cost_s == pytest.approx(0.0008)  # the EWMA moved toward 0
    proposer.close()
