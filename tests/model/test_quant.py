"""Quantized stages (int8, int4) and narrower KV caches: accuracy, splits, bytes held."""

from __future__ import annotations

import ctypes
import gc
import math
import pathlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.decode import RANDOM_CONFIGS
from meshd.bench.single_node import generate
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.config import parse_config
from meshd.model.kernels import cpu_kernels, unavailable_reason
from meshd.model.quant import Int8Fbgemm, Int8Vnni, matrix_bytes, quantize_matrix
from meshd.model.quant_int4 import Int4Cpu, Int4Vnni
from meshd.model.quant_matrix import QuantMatrix
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


@pytest.fixture(params=["meshd", "torch"])
def int8_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each x86 kernel family in turn: meshd's own (where this CPU runs them) and torch's
    (fbgemm for int8, int4pack for int4)."""
    kind = request.param
    monkeypatch.setenv("MESHD_QUANT_KERNELS", "auto" if kind == "meshd" else "torch")
    cpu_kernels.cache_clear()
    if kind == "meshd" and cpu_kernels() is None:
        pytest.skip(f"meshd's int8 kernel does not run here: {unavailable_reason()}")
    yield kind
    cpu_kernels.cache_clear()  # before the environment is restored: the next call re-decides


INT8_CLASSES = {"meshd": Int8Vnni, "torch": Int8Fbgemm}
INT4_CLASSES = {"meshd": Int4Vnni, "torch": Int4Cpu}


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


# --- matrices ------------------------------------------------------------------------------


def test_quantized_matrices_compute_what_their_weights_say(int8_kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 130, generator=gen)  # [out, in]; 130: not a multiple of 4 or 16
    x = torch.randn(5, 130, generator=gen)
    int8 = quantize_matrix(w, "int8", CPU, torch.float32)
    int4 = quantize_matrix(w[:, :128], "int4", CPU, torch.float32)
    assert isinstance(int8, INT8_CLASSES[int8_kind]) and isinstance(int4, INT4_CLASSES[int8_kind])
    for q, weight_err, out_err in ((int8, 0.01, 0.02), (int4, 0.15, 0.15)):
        k = q.in_features
        assert (k, q.out_features) == (int8.in_features if q is int8 else 128, 96)
        deq = q.dequantize()  # [in, out]
        assert deq.shape == (k, 96)
        # The stored weights are w rounded to 8 (4) bits; the product is the stored weights'.
        assert rel_err(deq, w[:, :k].t()) < weight_err
        assert rel_err(q.mm(x[:, :k]), x[:, :k] @ deq) < 0.01
        assert rel_err(q.mm(x[:, :k]), x[:, :k] @ w[:, :k].t()) < out_err
        assert q.mm(x[:, :k].bfloat16()).dtype == torch.bfloat16
    # int8 rounds each weight to the nearest of 255 steps of its row's range.
    step = w.abs().amax(1) / 127
    assert ((int8.dequantize().t() - w).abs() <= step[:, None] / 2 + 1e-6).all()


def test_int8_quantizes_activations_per_row(int8_kind: str) -> None:
    # fbgemm picks one activation scale per call; a batched pass must not let a large row
    # (another session, a long prefill) coarsen a small row's quantization.
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen)
    q = quantize_matrix(w, "int8", CPU, torch.float32)
    small, large = torch.randn(1, 256, generator=gen), 1000 * torch.randn(1, 256, generator=gen)
    together = q.mm(torch.cat((small, large)))
    assert rel_err(together[:1], small @ w.t()) < 0.02
    # Not just close: the row's bits are those of a call with that row alone.
    assert torch.equal(together[:1], q.mm(small))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_rows_product_does_not_depend_on_its_batch(quantization: str, int8_kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(512, 256, generator=gen)
    q = quantize_matrix(w, quantization, CPU, torch.float32)
    scales = torch.logspace(-6, 6, 200)
    x = torch.randn(200, 256, generator=gen) * scales[:, None]
    x += torch.randn(200, 1, generator=gen) * scales.flip(0)[:, None]  # offsets >> ranges too
    x[3] = x[3].abs() + 0.1  # all positive
    x[7] = 0.25  # constant
    full = q.mm(x)
    assert all(torch.equal(q.mm(x[i : i + 1]), full[i : i + 1]) for i in range(200))
    assert all(torch.equal(q.mm(x[i : i + 7]), full[i : i + 7]) for i in range(0, 193, 3))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_window_computes_the_bits_of_single_steps(
    tmp_path: pathlib.Path, family: str, quantization: str, int8_kind: str
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


def test_int4_falls_back_to_int8_where_its_kernel_does_not_fit(int8_kind: str) -> None:
    # 40 output channels: torch's CPU int4 kernel needs multiples of 16 (meshd's pads its
    # tiles); 50 inputs: no int4 group of 32 or 64 divides them, for either kernel.
    q = quantize_matrix(torch.randn(40, 64), "int4", CPU, torch.float32)
    assert q.kind == ("int4" if int8_kind == "meshd" else "int8")
    assert q.nbytes == matrix_bytes(64, 40, "int4", torch.float32)
    q = quantize_matrix(torch.randn(48, 50), "int4", CPU, torch.float32)
    assert q.kind == "int8" and q.nbytes == matrix_bytes(50, 48, "int4", torch.float32)
    if int8_kind == "torch":
        assert matrix_bytes(64, 48, "int4", torch.float32) == 64 * 48 // 2 + 4 * 48


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _heap_bytes() -> int:
    """Bytes in use on the C heap (glibc): what torch and fbgemm allocate on the CPU."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    gc.collect()
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


@pytest.mark.skipif(
    not pathlib.Path("/usr/include/malloc.h").exists()
    and not pathlib.Path("/lib/x86_64-linux-gnu/libc.so.6").exists(),
    reason="needs glibc's mallinfo2",
)
@pytest.mark.parametrize(("out_f", "in_f"), [(1536, 1024), (1024, 2816), (768, 256)])
def test_int8_bytes_are_what_it_allocates(out_f: int, in_f: int, int8_kind: str) -> None:
    # fbgemm's packed weight is opaque to torch; the byte figure comes from its blocking
    # rules, checked here against what the C heap really grew by (and for meshd's kernel,
    # from its tiles).
    # Three matrices, each kept, the median growth compared: anything else the process frees
    # meanwhile (a cache let go by an earlier test) shifts one measurement, not the median.
    w = torch.randn(out_f, in_f)
    kept, grown = [], []
    for _ in range(3):
        before = _heap_bytes()
        kept.append(quantize_matrix(w, "int8", CPU, torch.float32))
        grown.append(_heap_bytes() - before)
    q = kept[0]
    assert isinstance(q, INT8_CLASSES[int8_kind])
    assert abs(sorted(grown)[1] - q.nbytes) <= 0.01 * q.nbytes + 8192, grown
    assert q.nbytes == matrix_bytes(in_f, out_f, "int8", torch.float32)


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
        # hidden 256 is half of fbgemm's 512-row block, and the tied table is held twice
        # (int8 rows for lookups, a quantized head): int8 still holds about half of fp32.
        assert stages[0].weight_bytes < fp32 * (0.6 if quantization == "int8" else 0.25)


def test_int8_bytes_per_parameter_on_a_246m_llama() -> None:
    # The `large` random checkpoint of `meshd bench decode`: llama.cpp's q8_0 holds 1.0625
    # bytes per parameter (blocks of 32 int8 + an f16 scale); int8 here stays within 1.15x.
    config = parse_config(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
         "max_position_embeddings": 4096} | RANDOM_CONFIGS["large"]
    )  # fmt: skip
    n = config.num_layers
    params = stage_weight_bytes(config, 0, n, torch.float32, "none") // 4
    int8 = stage_weight_bytes(config, 0, n, torch.float32, "int8")
    int4 = stage_weight_bytes(config, 0, n, torch.float32, "int4")
    assert int8 / params <= 1.15 * 1.0625
    # int4 layers hold 0.5625 bytes per parameter; the embedding and head stay int8 (more than
    # a quarter of the int8 total on this checkpoint).
    assert int4 < 0.7 * int8
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
    assert all(isinstance(m, QuantMatrix) for s in stages for m in s.weight_matrices())
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
    # Measured on these prompts (x86, AVX-512 VNNI): first divergence after 21.0 (int8) and
    # 11.0 (int4) of 32 tokens on average; cross-entropy of fp32's own greedy text +0.4 % and
    # +3.7 % (held-out bits/byte, scripts/quant_quality.py: +0.08 % and +0.14 %).
    [("int8", 12.0, 0.02), ("int4", 5.0, 0.08)],
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
        # Each row is quantized over its own range, whatever its batch mates.
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


# --- CUDA ----------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_cuda_weight_only_kernels(
    builtin: Checkpoint, code_prompts: list[list[int]], quantization: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 512, generator=gen), torch.randn(3, 512, generator=gen)
    cuda = torch.device("cuda")
    q = quantize_matrix(w, quantization, cuda, torch.bfloat16)
    assert q.device.type == "cuda" and q.kernel.startswith("_weight_int")
    assert q.nbytes == matrix_bytes(512, 256, quantization, torch.bfloat16, "cuda")
    deq = q.dequantize()
    assert rel_err(q.mm(x.to(cuda, torch.bfloat16)).float().cpu(), x @ deq) < 0.02
    assert rel_err(deq, w.t()) < (0.01 if quantization == "int8" else 0.15)
    n = builtin.config.num_layers
    stage = StageModel.load(
        builtin, 0, n, device="cuda", dtype=torch.bfloat16, quantization=quantization
    )
    reference = whole(builtin)
    assert stage.weight_bytes == stage_weight_bytes(
        builtin.config, 0, n, torch.bfloat16, quantization, "cuda"
    )
    prompt = code_prompts[0]
    tokens = generate([stage], prompt, 16).tokens
    assert first_divergence(tokens, generate([reference], prompt, 16).tokens) >= 2
    assert not math.isnan(float(len(tokens)))
