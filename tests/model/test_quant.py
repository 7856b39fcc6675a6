"""Quantized stages under the names `int8` and `int4` (aliases of the block formats q8_0 and
q4_k) and narrower KV caches: accuracy, splits, bytes held."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.decode import RANDOM_CONFIGS
from meshd.bench.single_node import generate
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.config import parse_config
from meshd.model.gguf_matrix import GgufMatrix
from meshd.model.stage import StageModel, kv_bytes_per_token, layer_bytes, stage_weight_bytes
from meshd.model.tokenizer import Tokenizer

CPU = torch.device("cpu")
PROMPT = [1, 5, 99, 23, 23, 180, 7, 64, 2, 211, 17, 42]
SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
# Code prompts for the built-in model (not from its training files).
CODE_PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef walk(root):",
    "class Stack:\n    def __init__(self):",
    "def read_config(path):\n    with open(path) as f:",
    "for i in range(10):",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()",
)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    directory = tmp_path_factory.mktemp("mistral")
    make_checkpoint(directory, "mistral", seed=11)
    return Checkpoint.open(directory)


@pytest.fixture(scope="module")
def builtin() -> Checkpoint:
    return Checkpoint.open(builtin_model_dir())


@pytest.fixture(scope="module")
def code_prompts() -> list[list[int]]:
    tok = Tokenizer.open(builtin_model_dir())
    return [tok.encode(p) for p in CODE_PROMPTS]


def whole(checkpoint: Checkpoint, **options: object) -> StageModel:
    n = checkpoint.config.num_layers
    return StageModel.load(checkpoint, 0, n, device="cpu", **options)  # type: ignore[arg-type]


def run(stages: list[StageModel], session: str, base_pos: int, ids: list[int]) -> torch.Tensor:
    x: torch.Tensor = torch.tensor(ids)
    for stage in stages:
        out = stage.forward(session, base_pos, x)
        x = out.hidden
    assert out.logits is not None
    return out.logits


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- the names ----------------------------------------------------------------------------


@pytest.mark.parametrize(("alias", "scheme"), [("int8", "q8_0"), ("int4", "q4_k")])
def test_the_old_names_load_the_block_formats(mistral: Checkpoint, alias: str, scheme: str) -> None:
    # A config, flag or bench that still says int8/int4 gets the block format it stands for:
    # the same ggml types, bytes and logits, and the stage reports the format's own name.
    old, new = whole(mistral, quantization=alias), whole(mistral, quantization=scheme)
    assert old.quantization == scheme

    def types(stage: StageModel) -> list[tuple[str, ...]]:
        matrices = stage.weight_matrices()
        assert all(isinstance(m, GgufMatrix) for m in matrices)
        return [tuple(t.name for t in m.types) for m in matrices if isinstance(m, GgufMatrix)]

    assert types(old) == types(new)
    assert old.weight_bytes == new.weight_bytes
    config = mistral.config
    assert layer_bytes(config, torch.float32, alias) == layer_bytes(config, torch.float32, scheme)
    for stage in (old, new):
        stage.open_session("s", 32)
    assert torch.equal(run([old], "s", 0, PROMPT), run([new], "s", 0, PROMPT))


# --- windows and stages --------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_window_computes_the_bits_of_single_steps(
    tmp_path: pathlib.Path, family: str, quantization: str
) -> None:
    # What makes speculation exact on quantized stages: a verify window's logits are bit for
    # bit those of the same positions decoded one at a time (mistral's sliding window of 6
    # hides the oldest keys of some rows).
    make_checkpoint(tmp_path, family, seed=4)
    checkpoint = Checkpoint.open(tmp_path)
    stage = StageModel.load(checkpoint, 0, 4, device="cpu", quantization=quantization)
    with torch.inference_mode():
        for sid in ("window", "steps"):
            stage.open_session(sid, 64)
            stage.forward(sid, 0, torch.tensor(PROMPT[:5]), logits_last_n=1)
        window = stage.forward("window", 5, torch.tensor(PROMPT[5:])).logits
        steps = [stage.forward("steps", 5 + i, torch.tensor([t])).logits for i, t in
                 enumerate(PROMPT[5:])]  # fmt: skip
    assert window is not None and window.shape[0] == len(PROMPT) - 5
    assert torch.equal(window, torch.cat([s for s in steps if s is not None]))


# --- stages --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_bytes_held_are_what_layer_bytes_says(
    tmp_path: pathlib.Path, family: str, quantization: str
) -> None:
    make_checkpoint(tmp_path, family, seed=2)
    checkpoint = Checkpoint.open(tmp_path)
    config = checkpoint.config
    for lo, hi in [(0, 4), *SPLITS[3]]:
        stage = StageModel.load(checkpoint, lo, hi, device="cpu", quantization=quantization)
        per_layer = layer_bytes(config, torch.float32, quantization)
        assert stage.bytes_per_layer == per_layer
        assert all(layer.nbytes() == per_layer for layer in stage.layers)
        expected = stage_weight_bytes(config, lo, hi, torch.float32, quantization)
        assert stage.weight_bytes == expected
    if quantization == "none":
        params = sum(p.numel() for p in stage.layers[0].tensors())
        assert per_layer == 4 * params


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_builtin_bytes_count_tied_head_and_mtp(builtin: Checkpoint, quantization: str) -> None:
    config = builtin.config
    assert config.tie_word_embeddings and config.num_mtp_layers > 0
    n = config.num_layers
    stages = [
        StageModel.load(builtin, lo, hi, device="cpu", quantization=quantization)
        for lo, hi in [(0, n), (0, 2), (2, n)]
    ]
    for stage in stages:
        expected = stage_weight_bytes(
            config, stage.layer_start, stage.layer_end, torch.float32, quantization
        )
        assert stage.weight_bytes == expected
    fp32 = stage_weight_bytes(config, 0, n, torch.float32, "none")
    if quantization != "none":
        # The tied table is held once, as the head (Q8_0 / Q6_K): q8_0 holds 0.27 of fp32's
        # bytes, q4_k 0.16.
        assert stages[0].weight_bytes < fp32 * (0.3 if quantization == "int8" else 0.2)


def test_int8_bytes_per_parameter_on_a_246m_llama() -> None:
    # The `large` random checkpoint of `meshd bench decode`: q8_0 (int8) holds llama.cpp's
    # 1.0625 bytes per parameter (blocks of 32 int8 + an f16 scale), norms aside.
    config = parse_config(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
         "max_position_embeddings": 4096} | RANDOM_CONFIGS["large"]
    )  # fmt: skip
    n = config.num_layers
    params = stage_weight_bytes(config, 0, n, torch.float32, "none") // 4
    int8 = stage_weight_bytes(config, 0, n, torch.float32, "int8")
    int4 = stage_weight_bytes(config, 0, n, torch.float32, "int4")
    assert int8 / params <= 1.01 * 1.0625
    # q4_k (int4) holds 0.5625 bytes per parameter, its head 0.82 (Q6_K).
    assert int4 < 0.6 * int8
    # Two stages hold what one does, plus nothing (no shared tensors counted twice).
    halves = [stage_weight_bytes(config, a, b, torch.float32, "int8") for a, b in [(0, 8), (8, n)]]
    assert sum(halves) == int8


def test_quantization_none_is_todays_fp32(mistral: Checkpoint) -> None:
    default, explicit = whole(mistral), whole(mistral, quantization="none")
    assert all(isinstance(m, torch.Tensor) for m in explicit.weight_matrices())
    for stage in (default, explicit):
        stage.open_session("s", 32)
    assert torch.equal(run([default], "s", 0, PROMPT), run([explicit], "s", 0, PROMPT))
    with pytest.raises(ValueError, match="int8"):
        whole(mistral, quantization="fp8")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("n_stages", sorted(SPLITS))
def test_quantized_split_computes_what_the_unsplit_stage_does(
    mistral: Checkpoint, quantization: str, n_stages: int
) -> None:
    # Each stage quantizes its own layers exactly as the whole model would, so a split model
    # gives the same bits: nodes holding parts of one int8 model agree on every token.
    unsplit = whole(mistral, quantization=quantization)
    stages = [
        StageModel.load(mistral, a, b, device="cpu", quantization=quantization)
        for a, b in SPLITS[n_stages]
    ]
    assert all(isinstance(m, GgufMatrix) for s in stages for m in s.weight_matrices())
    for s in [*stages, unsplit]:
        s.open_session("split", 32)
    for base, ids in ((0, PROMPT), (len(PROMPT), [77]), (len(PROMPT) + 1, [3])):
        assert torch.equal(run(stages, "split", base, ids), run([unsplit], "split", base, ids))


def test_builtin_int8_split_decodes_the_same_tokens(
    builtin: Checkpoint, code_prompts: list[list[int]]
) -> None:
    n = builtin.config.num_layers
    unsplit = whole(builtin, quantization="int8")
    split = [
        StageModel.load(builtin, a, b, device="cpu", quantization="int8")
        for a, b in [(0, 2), (2, 4), (4, n)]
    ]
    for prompt in code_prompts[:2]:
        assert generate(split, prompt, 24).tokens == generate([unsplit], prompt, 24).tokens


@pytest.mark.parametrize(
    ("quantization", "min_mean_agreement", "max_bpb_increase"),
    # Measured on these prompts: first divergence after 23.3 (int8 = q8_0) and 15.8 (int4 =
    # q4_k) of 32 tokens on average; cross-entropy of fp32's own greedy text -0.003 % and
    # -0.3 % (q4_0 would give 5.2 tokens).
    [("int8", 12.0, 0.02), ("int4", 8.0, 0.08)],
)
def test_builtin_quantized_stays_close_to_fp32(
    builtin: Checkpoint,
    code_prompts: list[list[int]],
    quantization: str,
    min_mean_agreement: float,
    max_bpb_increase: float,
) -> None:
    fp32, quantized = whole(builtin), whole(builtin, quantization=quantization)
    tokens = 32
    firsts = [
        first_divergence(
            generate([fp32], prompt, tokens).tokens, generate([quantized], prompt, tokens).tokens
        )
        for prompt in code_prompts
    ]
    assert sum(firsts) / len(firsts) >= min_mean_agreement, firsts
    # Cross-entropy of fp32's own greedy text under each (a proxy for held-out bits/byte).
    text = code_prompts[0] + generate([fp32], code_prompts[0], 96).tokens
    losses = []
    for stage in (fp32, quantized):
        stage.open_session("ce", len(text))
        logits = stage.forward("ce", 0, torch.tensor(text[:-1])).logits
        stage.close_session("ce")
        assert logits is not None
        losses.append(F.cross_entropy(logits, torch.tensor(text[1:])).item())
    assert losses[1] <= losses[0] * (1 + max_bpb_increase) + 0.01, losses


def test_quantized_batched_pass_matches_single_windows(
    builtin: Checkpoint, code_prompts: list[list[int]]
) -> None:
    stage = whole(builtin, quantization="int8")
    a, b = code_prompts[0], code_prompts[1]
    for sid in ("a", "b", "a1", "b1"):
        stage.open_session(sid, 64)
    alone = [run([stage], "a1", 0, a), run([stage], "b1", 0, b)]
    together = stage.forward_batch([("a", 0, torch.tensor(a)), ("b", 0, torch.tensor(b))])
    for single, batched in zip(alone, together, strict=True):
        assert batched.logits is not None
        # Each row is quantized in its own blocks, whatever its batch mates.
        assert torch.equal(batched.logits, single)


# --- KV cache precision --------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_narrower_kv_cache_halves_its_bytes_and_still_decodes(
    builtin: Checkpoint, code_prompts: list[list[int]], kv_dtype: torch.dtype
) -> None:
    config = builtin.config
    fp32, narrow = whole(builtin), whole(builtin, kv_dtype=kv_dtype)
    n_cached = config.num_layers + config.num_mtp_layers
    assert narrow.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    assert narrow.kv_bytes_per_token == kv_bytes_per_token(config, n_cached, kv_dtype)
    narrow.open_session("kv", 100)
    assert narrow.kv.used_bytes == 100 * narrow.kv_bytes_per_token
    assert narrow.kv.get("kv").main.kv.dtype == kv_dtype
    narrow.close_session("kv")
    # Attention reads the narrower cache in fp32: logits stay within rounding of fp32's.
    prompt = code_prompts[0]
    for stage in (fp32, narrow):
        stage.open_session("cmp", 64)
    reference = run([fp32], "cmp", 0, prompt)
    got = run([narrow], "cmp", 0, prompt)
    assert got.dtype == torch.float32
    assert rel_err(got, reference) < (2e-3 if kv_dtype == torch.float16 else 1e-2)
    # Measured: float16 KV decodes fp32's exact tokens on all 50 held-out prompts x 64.
    if kv_dtype == torch.float16:
        for prompt in code_prompts[:3]:
            assert generate([narrow], prompt, 32).tokens == generate([fp32], prompt, 32).tokens


def test_kv_dtype_works_with_quantized_weights_and_mtp(builtin: Checkpoint) -> None:
    stage = whole(builtin, quantization="int8", kv_dtype=torch.bfloat16)
    assert stage.kv.layout.dtype == torch.bfloat16
    stage.open_session("m", 32)
    out = stage.forward("m", 0, torch.tensor(PROMPT))
    drafted = stage.mtp_forward("m", 1, 0, out.hidden[:-1], torch.tensor(PROMPT[1:]))
    assert torch.isfinite(drafted.logits).all() and drafted.logits.shape[0] == len(PROMPT) - 1
