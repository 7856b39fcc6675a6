"""Structured output through the window loop, against the built-in model's real stages.

The coordinator's grammar masks every choosing row of every window; drafts the grammar
forbids are cut before they leave. With speculation the committed tokens must equal plain
one-token windows under the same grammar and seed, and the text must be valid for the schema.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jsonschema
import pytest

from meshd.bench.checkpoints import make_checkpoint
from meshd.coord.generation import GenerationRequest
from meshd.coord.route_costs import RouteCosts
from meshd.coord.window_loop import WindowLoop
from meshd.model.tokenizer import Tokenizer
from meshd.speculative.config import SpecConfig
from meshd.speculative.grammar import Constraint, grammar_tokenizer, json_schema_grammar
from meshd.speculative.sampling import SamplingParams
from meshd.speculative.strategies import make_proposer
from protocol.messages import Sampling, VerifyWindow
from tests.coord.test_window_loop import DRAFT, MODEL, TWO_STAGES, shipped_draft
from tests.coord.virtual_route import VirtualRoute, drive, load_stages

TOKENIZER = Tokenizer.open(MODEL)
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "kind": {"enum": ["def", "class", "import"]},
        },
        "required": ["ok", "score", "kind"],
        "additionalProperties": False,
    },
]  # fmt: skip
PROMPT = TOKENIZER.encode("def parse(record):\n    return {", add_special_tokens=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A random 4-layer llama with the built-in model's tokenizer: its own choices are noise,
    so whatever it writes that parses is the grammar's doing."""
    directory = tmp_path_factory.mktemp("tiny")
    make_checkpoint(directory, vocab_size=TOKENIZER.vocab_size, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (MODEL / name).is_file():
            shutil.copy(MODEL / name, directory / name)
    return directory


def generate(
    schema: dict[str, Any],
    strategy: str,
    sampling: Sampling,
    model: pathlib.Path = MODEL,
    splits: list[tuple[int, int]] = TWO_STAGES,
) -> tuple[str, int]:
    net = VirtualRoute(load_stages(model, splits), hop_s=0.02)
    spec = SpecConfig(
        strategy=strategy,
        window_min_tokens=1,
        window_max_tokens=4,
        max_pipeline_depth=2,
        draft_model=str(DRAFT) if strategy == "draft" else "",
    )
    grammar = Constraint(grammar_tokenizer(TOKENIZER), json_schema_grammar(schema))
    request = GenerationRequest(
        prompt=PROMPT,
        max_tokens=200,
        spec=spec,
        sampling=sampling,
        eos_ids=frozenset(TOKENIZER.eos_ids),
        grammar=grammar,
    )
    costs = RouteCosts(stages=2)
    loop = WindowLoop(
        session="s",
        route=net.route,
        request=request,
        proposer=make_proposer(
            strategy,
            spec,
            link=costs.link_model(),
            draft=shipped_draft() if strategy == "draft" else None,
            sampling=SamplingParams(
                temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed
            ),
        ),
        costs=costs,
        coordinator_key=b"c" * 32,
        prefill_chunk_tokens=16,
        wire_dtype="f32",
    )
    drive(loop, net, PROMPT)
    result = loop.result()
    assert result.finish_reason == "stop"
    drafted = sum(
        m.n_draft for _, m in net.sent if isinstance(m, VerifyWindow) and m.base_pos >= len(PROMPT)
    )
    return TOKENIZER.decode(result.tokens, skip_special_tokens=True), drafted


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize(
    "sampling", [Sampling(), Sampling(temperature=1.0, seed=3)], ids=["greedy", "sampled"]
)
def test_speculation_commits_what_plain_decoding_does_and_the_json_validates(
    index: int, sampling: Sampling
) -> None:
    schema = SCHEMAS[index]
    plain, _ = generate(schema, "disabled", sampling)
    jsonschema.validate(json.loads(plain), schema)
    speculative, drafted = generate(schema, "draft", sampling)
    assert speculative == plain
    assert drafted > 0  # the speculative run did send drafts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_random_model_writes_valid_json_under_the_grammar(
    tiny: pathlib.Path, temperature: float
) -> None:
    schema = SCHEMAS[0]
    sampling = Sampling(temperature=temperature, seed=4)
    plain, _ = generate(schema, "disabled", sampling, tiny, [(0, 2), (2, 4)])
    jsonschema.validate(json.loads(plain), schema)
    speculative, _ = generate(schema, "ngram-simple", sampling, tiny, [(0, 2), (2, 4)])
    assert speculative == plain
