"""What a GGUF file describes to the runtime: its `ModelConfig` and its tensors by Hugging
Face name, checked without reading a tensor byte and without torch.

`open_gguf(path)` parses the file(s) (`meshd.model.gguf_file`), refuses an architecture or a
tensor type the runtime does not run, maps the metadata (`{arch}.block_count`, ...) to a
`ModelConfig` and GGUF tensor names (`blk.3.attn_q.weight`) to the Hugging Face names the
runtime uses (`model.layers.3.self_attn.q_proj.weight`), each with its byte range.

GGUF stores dimensions in ggml's order (`ne`, innermost first): a Hugging Face `[out, in]`
matrix is `ne = [in, out]`; `GGUFTensor.shape` is in Hugging Face order.
"""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from meshd.model.config import FAMILIES, ModelConfig, RopeConfig
from meshd.model.errors import CorruptCheckpoint, InvalidConfig, UnsupportedArchitecture
from meshd.model.gguf_file import GGUFMetadata, read_shards

if TYPE_CHECKING:
    from gguf import GGUFReader

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF `general.architecture` values we run
# Tensor types the runtime reads. Q4_1/Q5_0/Q5_1 are llama-quantize's fallbacks for rows that
# are not whole 256-value K-quant blocks, so K-quant files hold them.
TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_0", "Q4_K", "Q4_1",
)  # fmt: skip
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_CONTROL = 3  # gguf.TokenType.CONTROL
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# llama.cpp's text heuristic for end-of-generation tokens (llama-vocab.cpp), for files whose
# metadata names only one eos id.
EOG_TEXTS = frozenset(
    ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
     "<EOT>", "_<EOT>", "<|end_of_text|>")
)  # fmt: skip


class _Shaped(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class GGUFTensor:
    """One runtime tensor of a GGUF file: its names, ggml type and where its bytes lie."""

    name: str  # Hugging Face name
    gguf_name: str
    ggml_type: int
    type_name: str  # `Q4_K`, `F16`, ...
    shape: tuple[int, ...]  # Hugging Face order
    path: pathlib.Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFModel:
    """An opened, checked GGUF file (or every shard of a split model): see the module doc."""

    path: pathlib.Path
    readers: tuple[tuple[pathlib.Path, GGUFReader], ...]
    architecture: str
    config: ModelConfig
    tensors: Mapping[str, GGUFTensor]  # by Hugging Face name


def open_gguf(path: pathlib.Path) -> GGUFModel:
    """Parse and check a GGUF file (header, metadata and tensor table only; no torch).

    Raises a `ModelError` naming the file: damage, an unsupported architecture, or a runtime
    tensor of a type the runtime has no reader for (naming the tensor and its type).
    """
    readers = read_shards(path)
    path, first = readers[0]
    meta = GGUFMetadata(first, str(path))
    arch = architecture(meta)
    tensors = _tensor_table(readers)
    for tensor in tensors.values():
        if tensor.type_name not in TENSOR_TYPES:
            raise UnsupportedArchitecture(
                f"{path}: tensor {tensor.gguf_name!r} is stored as {tensor.type_name}; "
                f"supported GGUF types: {', '.join(TENSOR_TYPES)}"
            )
    config = config_from_gguf(meta, arch, tensors, _rope_factors(readers))
    return GGUFModel(path, tuple(readers), arch, config, tensors)


def gguf_name_to_hf(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for tensors the runtime ignores."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"


def hf_to_gguf_name(name: str) -> str:
    for gguf, hf in _GLOBAL_NAMES.items():
        if hf == name:
            return gguf
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match:
        for gguf, hf in _BLOCK_NAMES.items():
            if hf == match.group(2):
                return f"blk.{match.group(1)}.{gguf}"
    return name


def architecture(meta: GGUFMetadata) -> str:
    """The file's `general.architecture`, refused unless the runtime runs it."""
    arch = meta.string("general.architecture")
    if arch is None:
        raise InvalidConfig(f"{meta.source}: metadata 'general.architecture' is missing")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{meta.source}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _tensor_table(
    readers: list[tuple[pathlib.Path, GGUFReader]],
) -> dict[str, GGUFTensor]:
    """The runtime's tensors by Hugging Face name, each checked against its file."""
    tensors: dict[str, GGUFTensor] = {}
    for path, reader in readers:
        size = path.stat().st_size
        for tensor in reader.tensors:
            hf_name = gguf_name_to_hf(tensor.name)
            if hf_name is None:
                continue
            if hf_name in tensors:
                raise CorruptCheckpoint(f"{path}: tensor {tensor.name!r} is stored twice")
            tensors[hf_name] = _tensor(path, size, tensor, hf_name)
    return tensors


def _tensor(path: pathlib.Path, size: int, tensor: Any, hf_name: str) -> GGUFTensor:
    """One tensor's type, HF-order shape and byte range, checked against the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(tensor.tensor_type)
    ne = [int(d) for d in tensor.shape]
    block, type_size = GGML_QUANT_SIZES[qtype]
    if ne and ne[0] % block:
        raise CorruptCheckpoint(
            f"{path}: tensor {tensor.name!r} has rows of {ne[0]} values, not whole "
            f"{qtype.name} blocks of {block}"
        )
    nbytes = math.prod(ne) // block * type_size
    offset = int(tensor.data_offset)
    if offset + nbytes > size:
        raise CorruptCheckpoint(
            f"{path}: tensor {tensor.name!r} lies beyond the end of the file ({size} bytes)"
        )
    shape = tuple(reversed(ne))
    return GGUFTensor(hf_name, tensor.name, int(qtype), qtype.name, shape, path, offset, nbytes)


def _rope_factors(readers: list[tuple[pathlib.Path, GGUFReader]]) -> np.ndarray | None:
    """llama.cpp's per-frequency RoPE divisors (`rope_freqs.weight`, Llama 3 scaling), if any."""
    for path, reader in readers:
        for tensor in reader.tensors:
            if tensor.name == "rope_freqs.weight":
                if tensor.tensor_type != 0:  # F32
                    raise UnsupportedArchitecture(f"{path}: rope_freqs.weight is not F32")
                return np.array(tensor.data, dtype=np.float32).reshape(-1)
    return None


def config_from_gguf(
    meta: GGUFMetadata,
    arch: str,
    infos: Mapping[str, _Shaped],
    rope_factors: np.ndarray | None,
) -> ModelConfig:
    """Map GGUF metadata (`{arch}.block_count`, ...) to the runtime's `ModelConfig`."""
    source = meta.source
    experts = meta.value(f"{arch}.expert_count", 0)
    if experts:
        raise UnsupportedArchitecture(
            f"{source}: mixture-of-experts GGUF ({arch}.expert_count = {experts}) is not supported"
        )
    hidden = meta.integer(f"{arch}.embedding_length")
    heads = meta.integer(f"{arch}.attention.head_count")
    kv_heads = meta.integer(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // heads)
    value_dim = meta.integer(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedArchitecture(
            f"{source}: attention.value_length ({value_dim}) != key_length ({head_dim})"
        )
    rope_dim = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedArchitecture(
            f"{source}: partial RoPE ({arch}.rope.dimension_count {rope_dim} of {head_dim})"
        )
    if heads % kv_heads:
        raise InvalidConfig(
            f"{source}: head_count ({heads}) is not a multiple of head_count_kv ({kv_heads})"
        )
    if head_dim % 2:
        raise InvalidConfig(f"{source}: head dim ({head_dim}) must be even for RoPE")
    layers = meta.integer(f"{arch}.block_count")
    embed = infos.get("model.embed_tokens.weight")
    vocab = embed.shape[0] if embed is not None else meta.integer(f"{arch}.vocab_size")
    family = arch
    window: int | None = None
    sliding: tuple[bool, ...] = (False,) * layers
    swa = meta.value(f"{arch}.attention.sliding_window")
    if swa is not None and arch == "llama":
        # Mistral 7B's window. llama.cpp's converter writes Mistral as plain `llama` without
        # it (and runs full attention); a file that names a window gets it on every layer.
        family, window = "mistral", meta.integer(f"{arch}.attention.sliding_window")
        sliding = (True,) * layers
    assert family in FAMILIES
    layer0 = "model.layers.0."
    bos = meta.optional_id("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.integer(f"{arch}.feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        max_position_embeddings=meta.integer(f"{arch}.context_length", 2048),
        rope=_rope(meta, arch, head_dim, rope_factors),
        tie_word_embeddings="lm_head.weight" not in infos,
        qkv_bias=layer0 + "self_attn.q_proj.bias" in infos,
        o_bias=layer0 + "self_attn.o_proj.bias" in infos,
        mlp_bias=layer0 + "mlp.up_proj.bias" in infos,
        qk_norm=layer0 + "self_attn.q_norm.weight" in infos,
        sliding_window=window,
        sliding_layers=sliding,
        bos_token_id=bos,
        eos_token_ids=stop_ids(meta),
    )


def stop_ids(meta: GGUFMetadata) -> tuple[int, ...]:
    """End-of-generation ids: eos/eot/eom, plus control tokens llama.cpp treats as such."""
    ids = [
        i
        for key in ("eos", "eot", "eom")
        if (i := meta.optional_id(f"tokenizer.ggml.{key}_token_id")) is not None
    ]
    tokens = meta.value("tokenizer.ggml.tokens") or []
    types = meta.value("tokenizer.ggml.token_type") or []
    n = min(len(tokens), len(types))
    control = np.flatnonzero(np.asarray(types[:n]) == _CONTROL).tolist() if n else []
    ids += [i for i in control if tokens[i] in EOG_TEXTS]
    return tuple(dict.fromkeys(ids))


def _rope(meta: GGUFMetadata, arch: str, head_dim: int, factors: np.ndarray | None) -> RopeConfig:
    theta = meta.number(f"{arch}.rope.freq_base", 10000.0)
    scaling = meta.string(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = meta.number(f"{arch}.rope.scaling.factor", 1.0)
        if factors is not None:
            raise UnsupportedArchitecture(f"{meta.source}: rope_freqs with linear RoPE scaling")
        return RopeConfig(rope_type="linear", theta=theta, factor=factor)
    if scaling != "none":
        raise UnsupportedArchitecture(
            f"{meta.source}: RoPE scaling {scaling!r} is not supported (supported: none, "
            "linear, llama3 via rope_freqs)"
        )
    if factors is None:
        return RopeConfig(theta=theta)
    return llama3_rope_from_factors(factors, theta, head_dim, meta.source)


def llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, source: str
) -> RopeConfig:
    """Recover Llama 3 RoPE scaling from llama.cpp's per-frequency divisors (`rope_freqs`).

    The converter writes `r_i = 1 / ((1 - s_i) / factor + s_i)` with
    `s_i = (L / wavelen_i - low) / (high - low)` between the two wavelength bounds, 1 above
    and `factor` below them. Every Llama 3.x release uses low = 1, high = 4; `factor` is the
    largest divisor and `L` (the original context) follows from any smoothed frequency. The
    result must reproduce every stored divisor, or the file is refused.
    """
    n = head_dim // 2
    if factors.shape != (n,):
        raise UnsupportedArchitecture(
            f"{source}: rope_freqs has {factors.size} values, expected {n} (head_dim / 2)"
        )
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    low, high = 1.0, 4.0
    original = 8192
    medium = [(w, float(r)) for w, r in zip(wavelen, factors, strict=True) if 1 < r < factor]
    if medium and factor > 1:
        w, r = medium[0]
        smooth = (1 / r - 1 / factor) / (1 - 1 / factor)
        original = round(w * (smooth * (high - low) + low))
    elif factor > 1:
        # No smoothed frequency: any context between the last unscaled and first scaled
        # wavelength gives the same divisors; take the smallest power of two that does.
        scaled = wavelen[factors >= factor]
        original = 2 ** math.ceil(math.log2(float(scaled.min()) * low)) if scaled.size else 8192
    rope = RopeConfig(
        rope_type="llama3",
        theta=theta,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=max(1, original),
    )
    if not np.allclose(_llama3_divisors(rope, wavelen), factors, rtol=1e-4, atol=0):
        raise UnsupportedArchitecture(
            f"{source}: rope_freqs is not Llama 3 RoPE scaling with low/high frequency "
            "factors 1/4 (other per-frequency scalings are not supported)"
        )
    return rope


def _llama3_divisors(rope: RopeConfig, wavelen: np.ndarray) -> np.ndarray:
    """The converter's `rope_factors` for `rope` (generate_extra_tensors in llama.py)."""
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    mid = 1 / ((1 - smooth) / rope.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, rope.factor, mid))
