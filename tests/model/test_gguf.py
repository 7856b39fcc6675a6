"""GGUF files as models: exact F32 equivalence, quantized agreement, laziness, errors."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.gguf_writer import pack_q4_k, pack_q5_k, pack_q6_k, permute, write_gguf
from meshd.bench.single_node import generate
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import (
    CorruptCheckpoint,
    MissingFile,
    ModelError,
    UnsupportedArchitecture,
)
from meshd.model.files import model_name, open_checkpoint, open_tokenizer
from meshd.model.gguf_checkpoint import GGUFCheckpoint, dequantize, unpermute_rows
from meshd.model.stage import StageModel

PROMPT = [1, 5, 99, 23, 23, 180, 7, 64, 2, 211, 17, 3]  # longer than mistral's window (6)
FAMILIES = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3"]


def stage_logits(stage: StageModel, ids: list[int]) -> torch.Tensor:
    stage.open_session("t", len(ids) + 1)
    try:
        out = stage.forward("t", 0, torch.tensor(ids))
    finally:
        stage.close_session("t")
    assert out.logits is not None
    return out.logits


def whole(checkpoint: Checkpoint) -> StageModel:
    return StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")


@pytest.fixture(scope="module")
def builtin_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_gguf(builtin_model_dir(), tmp_path_factory.mktemp("gguf") / "builtin.gguf")


def test_f32_gguf_of_the_builtin_model_gives_exactly_its_tokens_and_logits(
    builtin_gguf: pathlib.Path,
) -> None:
    directory = open_checkpoint(builtin_model_dir())
    checkpoint = open_checkpoint(builtin_gguf)
    assert isinstance(checkpoint, GGUFCheckpoint)
    assert checkpoint.default_quantization == "none"
    # The same model as the directory, less the MTP heads GGUF has no place for.
    assert checkpoint.config == msgspec_replace(directory.config, num_mtp_layers=0)
    ours, theirs = whole(checkpoint), whole(directory)
    ids = open_tokenizer(builtin_gguf).encode("Once upon a time, there was a little")
    assert torch.equal(stage_logits(ours, ids), stage_logits(theirs, ids))
    assert generate([ours], ids, 24).tokens == generate([theirs], ids, 24).tokens


def msgspec_replace(config: object, **changes: object) -> object:
    import msgspec

    return msgspec.structs.replace(config, **changes)  # type: ignore[type-var]


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_of_each_family_gives_exactly_the_directorys_logits(
    tmp_path: pathlib.Path, family: str
) -> None:
    make_checkpoint(tmp_path / "hf", family, seed=3)
    # Mistral's window is not written by llama.cpp's converter; this file names it.
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", sliding_window=family == "mistral")
    directory, checkpoint = open_checkpoint(tmp_path / "hf"), open_checkpoint(path)
    assert checkpoint.config == directory.config
    ours, theirs = whole(checkpoint), whole(directory)
    assert torch.equal(stage_logits(ours, PROMPT), stage_logits(theirs, PROMPT))
    assert generate([ours], PROMPT, 12).tokens == generate([theirs], PROMPT, 12).tokens


def test_mistral_without_its_window_in_the_file_runs_full_attention(
    tmp_path: pathlib.Path,
) -> None:
    make_checkpoint(tmp_path / "hf", "mistral", seed=3)
    checkpoint = open_checkpoint(write_gguf(tmp_path / "hf", tmp_path / "m.gguf"))
    assert checkpoint.config.family == "llama" and checkpoint.config.sliding_window is None
    directory = open_checkpoint(tmp_path / "hf")
    ours, theirs = whole(checkpoint), whole(directory)
    # Within the window (6 tokens) both attend to the same positions.
    assert torch.equal(stage_logits(ours, PROMPT[:6]), stage_logits(theirs, PROMPT[:6]))
    assert not torch.equal(stage_logits(ours, PROMPT), stage_logits(theirs, PROMPT))


def test_f16_and_bf16_ggufs_give_the_directory_cast_to_that_dtype(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "qwen2", seed=5)
    directory = open_checkpoint(tmp_path / "hf")
    for kind, dtype in (("F16", torch.float16), ("BF16", torch.bfloat16)):
        checkpoint = open_checkpoint(write_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf", kind))
        # Half-precision matrices run as stored: converting them would double their bytes.
        assert checkpoint.default_quantization == "gguf"
        name = "model.layers.1.self_attn.q_proj.weight"
        (_, got), (_, want) = *checkpoint.load([name]), *directory.load([name])
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_llama_q_and_k_rows_come_back_in_hugging_face_order(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "llama", seed=2, attention_bias=True)
    checkpoint = open_checkpoint(write_gguf(tmp_path / "hf", tmp_path / "m.gguf"))
    directory = open_checkpoint(tmp_path / "hf")
    names = [
        f"model.layers.0.self_attn.{p}.{k}"
        for p in ("q_proj", "k_proj")
        for k in ("weight", "bias")
    ]
    for (name, got), (_, want) in zip(checkpoint.load(names), directory.load(names), strict=True):
        assert torch.equal(got, want), name
    # The file itself holds llama.cpp's permuted rows (k: 2 kv heads).
    k = next(directory.load(["model.layers.0.self_attn.k_proj.weight"]))[1]
    stored = torch.from_numpy(permute(k.numpy(), 4, 2))
    assert not torch.equal(stored, k) and torch.equal(unpermute_rows(stored, 2), k)


class Reference:
    """The fp32 directory's greedy tokens and logits per prompt, computed once per module."""

    def __init__(self, stage: StageModel, prompts: list[list[int]], n: int) -> None:
        self.prompts, self.n = prompts, n
        self.tokens = [generate([stage], ids, n).tokens for ids in prompts]
        self.logits = [stage_logits(stage, ids) for ids in prompts]


def agreement(ours: StageModel, reference: Reference) -> dict[str, float]:
    """Greedy agreement and logits cosine of a whole-model stage with the reference."""
    same, first, cosine = [], [], []
    for ids, b, lb in zip(reference.prompts, reference.tokens, reference.logits, strict=True):
        a, n = generate([ours], ids, reference.n).tokens, reference.n
        same.append(sum(x == y for x, y in zip(a, b, strict=True)) / n)
        first.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), n))
        cosine.append(float(F.cosine_similarity(stage_logits(ours, ids), lb, dim=-1).min()))
    return {
        "identical": sum(same) / len(same),
        "first_divergence_median": float(np.median(first)),
        "min_cosine": min(cosine),
    }


PROMPTS = [
    "Once upon a time",
    "The little dog",
    "She said",
    "In the morning, the sun",
    "Tom and Lily went to the park",
    "One day, a girl named",
    "The cat was very",
    "He wanted to",
]
# Builtin model, 8 prompts x 32 greedy tokens vs the fp32 directory (docs/model-runtime.md).
# Measured: Q8_0 identical 0.67, first divergence median 32, min cosine 0.99998;
# Q4_K (+ Q5_0 for the 704-wide ffn_down rows) identical 0.16, median 2.5, min cosine 0.9959.
QUANTIZED = {
    "Q8_0": ({}, 0.5, 0.9999),
    "Q4_K": ({f"blk.{i}.ffn_down.weight": "Q5_0" for i in range(6)}, 0.08, 0.99),
}


@pytest.fixture(scope="module")
def builtin_reference() -> Reference:
    tok = open_tokenizer(builtin_model_dir())
    stage = whole(open_checkpoint(builtin_model_dir()))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run outside conftest's one-thread fixture
    try:
        return Reference(stage, [tok.encode(p) for p in PROMPTS], 32)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kind", sorted(QUANTIZED))
def test_quantized_ggufs_agree_with_the_builtin_model_as_measured(
    tmp_path: pathlib.Path, kind: str, builtin_reference: Reference
) -> None:
    types, min_identical, min_cosine = QUANTIZED[kind]
    checkpoint = open_checkpoint(
        write_gguf(builtin_model_dir(), tmp_path / "q.gguf", kind, types=types)
    )
    assert checkpoint.default_quantization == "gguf"
    assert checkpoint.tensors["model.layers.0.mlp.up_proj.weight"].dtype == kind
    figures = agreement(whole(checkpoint), builtin_reference)
    assert figures["identical"] >= min_identical, figures
    assert figures["min_cosine"] >= min_cosine, figures


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_every_quantized_type_dequantizes_close_to_the_weights(
    tmp_path: pathlib.Path, kind: str
) -> None:
    # Rows of 256 values: whole K-quant blocks.
    make_checkpoint(
        tmp_path / "hf",
        "llama",
        seed=6,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
    )
    checkpoint = open_checkpoint(write_gguf(tmp_path / "hf", tmp_path / "q.gguf", kind))
    # Never silently fp32: a quantized file runs as stored.
    assert checkpoint.default_quantization == "gguf"
    directory = open_checkpoint(tmp_path / "hf")
    names = [n for n in directory.tensors if n.endswith("proj.weight")]
    # Worst relative error measured over these matrices: Q8_0 0.0054, Q6_K 0.0194, Q5_K 0.0384,
    # Q4_K 0.0786 (the test packers: plain min/max scales, not llama-quantize's search), Q4_0 0.0864.
    error = {"Q8_0": 0.007, "Q6_K": 0.025, "Q5_K": 0.05, "Q4_K": 0.1, "Q4_0": 0.11}[kind]
    for (name, got), (_, want) in zip(checkpoint.load(names), directory.load(names), strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        relative = float((got - want).norm() / want.norm())
        assert relative < error, (name, relative)
    # Random weights amplify any error layer after layer, so only check the stage runs on them
    # (the built-in model's agreement test measures logits and tokens).
    assert stage_logits(whole(checkpoint), PROMPT).isfinite().all()


def test_known_k_quant_blocks_decode_to_their_values() -> None:
    """Blocks built by hand from the format (not by the packers) decode as llama.cpp's."""
    # Q4_K: d = 0.5, dmin = 0.25, sub-block j scale j+1 and min j, every q = j (low) / 15-j (high).
    sc, mn = np.arange(1, 9, dtype=np.uint8), np.arange(8, dtype=np.uint8)
    scales = np.concatenate(
        [
            sc[:4] | ((sc[4:] >> 4) << 6),
            mn[:4] | ((mn[4:] >> 4) << 6),
            (sc[4:] & 15) | ((mn[4:] & 15) << 4),
        ]
    )
    qs = np.concatenate([np.full(32, (2 * k) | ((15 - 2 * k) << 4), np.uint8) for k in range(4)])
    block = np.concatenate(
        [
            np.float16(0.5).reshape(1).view(np.uint8),
            np.float16(0.25).reshape(1).view(np.uint8),
            scales,
            qs,
        ]
    )
    expected = np.concatenate(
        [
            np.full(32, 0.5 * sc[j] * (j if j % 2 == 0 else 15 - (j - 1)) - 0.25 * mn[j])
            for j in range(8)
        ]
    ).astype(np.float32)
    got = dequantize(block, int(gguf.GGMLQuantizationType.Q4_K), (256,))
    assert torch.equal(got, torch.from_numpy(expected))
    # The test packers invert that layout (and Q5_K's / Q6_K's) to within quantization error.
    values = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    for pack, qtype, tolerance in (
        (pack_q4_k, "Q4_K", 0.12),
        (pack_q5_k, "Q5_K", 0.06),
        (pack_q6_k, "Q6_K", 0.03),
    ):
        decoded = dequantize(
            pack(values).reshape(-1), int(gguf.GGMLQuantizationType[qtype]), (4, 512)
        )
        relative = np.linalg.norm(decoded.numpy() - values) / np.linalg.norm(values)
        assert relative < tolerance, (qtype, relative)


def _poison(path: pathlib.Path, checkpoint: Checkpoint, keep: tuple[str, ...]) -> None:
    raw = bytearray(path.read_bytes())
    for name, info in checkpoint.tensors.items():
        if not name.startswith(keep):
            raw[info.offset : info.offset + info.nbytes] = b"\xff" * info.nbytes
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_a_middle_stage_reads_only_its_layers(tmp_path: pathlib.Path, kind: str) -> None:
    make_checkpoint(tmp_path / "hf", "llama", seed=4, num_hidden_layers=6)
    clean = write_gguf(tmp_path / "hf", tmp_path / "clean.gguf", kind)
    poisoned_path = write_gguf(tmp_path / "hf", tmp_path / "poisoned.gguf", kind)
    mine = ("model.layers.2.", "model.layers.3.")
    _poison(poisoned_path, open_checkpoint(poisoned_path), mine)
    poisoned = open_checkpoint(poisoned_path)

    stage = StageModel.load(poisoned, 2, 4)
    assert poisoned.loaded_names == {n for n in poisoned.tensors if n.startswith(mine)}
    reference = StageModel.load(open_checkpoint(clean), 2, 4)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for s in (stage, reference):
        s.open_session("s", 5)
    ours = stage.forward("s", 0, hidden).hidden
    assert ours.isfinite().all()
    assert torch.equal(ours, reference.forward("s", 0, hidden).hidden)


def test_a_split_gguf_model_is_one_model(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "qwen3", seed=7, num_hidden_layers=6)
    first = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0", split_max_tensors=20)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert first == shards[0] and len(shards) > 2
    whole_file = open_checkpoint(write_gguf(tmp_path / "hf", tmp_path / "one.gguf", "Q8_0"))
    for given in (shards[0], shards[-1]):  # any shard names the model
        checkpoint = open_checkpoint(given)
        assert checkpoint.config == whole_file.config
        assert {info.path for info in checkpoint.tensors.values()} == set(shards)
        assert torch.equal(
            stage_logits(whole(checkpoint), PROMPT), stage_logits(whole(whole_file), PROMPT)
        )
    ids = {open_checkpoint(s).model_id for s in shards}
    assert len(ids) == 1 and ids != {whole_file.model_id}
    # A middle stage reads only the shards holding its layers, and computes as the single file.
    checkpoint = open_checkpoint(shards[0])
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    ours, theirs = StageModel.load(checkpoint, 2, 4), StageModel.load(whole_file, 2, 4)
    for s in (ours, theirs):
        s.open_session("s", 4)
    assert torch.equal(ours.forward("s", 0, hidden).hidden, theirs.forward("s", 0, hidden).hidden)
    assert {checkpoint.tensors[n].path for n in checkpoint.loaded_names} < set(shards)
    shards[1].unlink()
    with pytest.raises(MissingFile) as exc:
        open_checkpoint(shards[0])
    one_line_error(exc, shards[1].name)


def test_the_model_id_is_the_files_and_every_node_computes_the_same(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "qwen3", seed=1)
    first = write_gguf(tmp_path / "hf", tmp_path / "a.gguf")
    copy = tmp_path / "node2" / "a.gguf"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    ids = {open_checkpoint(first).model_id, open_checkpoint(copy).model_id}
    assert len(ids) == 1
    assert open_checkpoint(first).model_id != open_checkpoint(tmp_path / "hf").model_id
    # Another precision of the same weights, or changed weights, is another model.
    assert (
        open_checkpoint(write_gguf(tmp_path / "hf", tmp_path / "b.gguf", "Q8_0")).model_id
        not in ids
    )
    make_checkpoint(tmp_path / "hf2", "qwen3", seed=2)
    assert open_checkpoint(write_gguf(tmp_path / "hf2", tmp_path / "c.gguf")).model_id not in ids


def one_line_error(exc: pytest.ExceptionInfo[ModelError], *words: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_unsupported_architecture_is_a_one_line_error(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "llama", seed=1)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", arch="gemma2")
    with pytest.raises(UnsupportedArchitecture) as exc:
        open_checkpoint(path)
    one_line_error(exc, "gemma2", "m.gguf")


def test_unsupported_tensor_type_is_a_one_line_error_naming_it(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "llama", seed=1)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", types={"blk.1.ffn_up.weight": "MXFP4"})
    with pytest.raises(UnsupportedArchitecture) as exc:
        open_checkpoint(path)
    one_line_error(exc, "blk.1.ffn_up.weight", "MXFP4")


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ({"llama.rope.scaling.type": "yarn"}, ["yarn"]),
        ({"llama.expert_count": 8}, ["expert_count"]),
    ],
)
def test_unsupported_features_are_one_line_errors(
    tmp_path: pathlib.Path, metadata: dict[str, object], words: list[str]
) -> None:
    make_checkpoint(tmp_path / "hf", "llama", seed=1)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", metadata=metadata)
    with pytest.raises(UnsupportedArchitecture) as exc:
        open_checkpoint(path)
    one_line_error(exc, *words)


def test_damaged_files_are_one_line_errors(
    tmp_path: pathlib.Path, builtin_gguf: pathlib.Path
) -> None:
    data = builtin_gguf.read_bytes()
    reader = gguf.GGUFReader(builtin_gguf)
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)  # the last tensor's last byte
    truncated = tmp_path / "t.gguf"
    for size in (len(data) // 2, end - 1):
        truncated.write_bytes(data[:size])
        with pytest.raises(CorruptCheckpoint) as exc:
            open_checkpoint(truncated)
        one_line_error(exc, "t.gguf", f"truncated: expected {end} bytes, file has {size}")
    truncated.write_bytes(data[:end])  # the padding after the last tensor is not needed
    assert open_checkpoint(truncated).tensors.keys() == open_checkpoint(builtin_gguf).tensors.keys()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(CorruptCheckpoint) as exc:
        open_checkpoint(junk)
    one_line_error(exc, "junk.gguf")
    with pytest.raises(MissingFile):
        open_checkpoint(tmp_path / "absent.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(MissingFile) as exc:
        open_checkpoint(other)
    one_line_error(exc, ".gguf")


def test_a_stage_of_the_gguf_reports_load_progress_in_file_bytes(
    builtin_gguf: pathlib.Path,
) -> None:
    checkpoint = open_checkpoint(builtin_gguf)
    calls: list[tuple[int, int]] = []
    StageModel.load(checkpoint, 0, 3, progress=lambda done, total: calls.append((done, total)))
    read = sum(checkpoint.tensors[n].nbytes for n in checkpoint.loaded_names)
    assert calls[-1] == (read, read) and len(calls) == len(checkpoint.loaded_names) + 1


def test_names_for_the_api(builtin_gguf: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert model_name(builtin_gguf) == "builtin"
    assert model_name(builtin_model_dir()) == "builtin"
    (tmp_path / "x.gguf").mkdir()  # a directory named *.gguf is still a directory
    with pytest.raises(MissingFile):
        open_checkpoint(tmp_path / "x.gguf")
