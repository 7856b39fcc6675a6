"""Write a Hugging Face checkpoint directory as a GGUF file, the way llama.cpp does (the
GGUF inputs of tests and benchmark scripts).

Mirrors `convert_hf_to_gguf.py` (llama.cpp, vendored in llama-cpp-python 0.3.36) for the four
families meshd runs: the same metadata keys, tensor names, the llama q/k row permutation
(`LlamaModel.permute`), Llama 3 RoPE as a `rope_freqs` tensor, norms and biases kept F32, tied
embeddings without `output.weight`, and the byte-level BPE vocabulary (`get_vocab_base` +
`gguf.SpecialVocab`). Matrices take the chosen type: F32/F16/BF16/Q8_0/Q4_0 through
`gguf.quants.quantize`; the `gguf` package has no quantizer for K-quants (only dequantizers),
so Q4_K/Q5_K/Q6_K blocks are packed here (`pack_q4_k` ...), in the bit layout its
dequantizers read.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
QK_K = 256


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    return f"blk.{parts[2]}.{_BLOCK[parts[3]]}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    src: pathlib.Path,
    dest: pathlib.Path,
    tensor_type: str = "F32",
    *,
    types: Mapping[str, str] | None = None,
    pre: str = "gpt-2",
    sliding_window: bool = False,
    metadata: Mapping[str, Any] | None = None,
    arch: str | None = None,
    split_max_tensors: int = 0,
    quantize: Callable[[np.ndarray, Q], np.ndarray] | None = None,
) -> pathlib.Path:
    """Convert checkpoint directory `src` to GGUF file `dest`; return `dest`.

    Every 2-D weight gets `tensor_type`, unless `types` names another for its GGUF name;
    1-D tensors stay F32 as in the converter. `sliding_window` writes Mistral's window as
    `llama.attention.sliding_window` (llama.cpp's converter drops it). `metadata` adds or
    overrides keys (value, or (value, GGUFValueType[, array item type])); `arch` overrides the
    architecture.
    `split_max_tensors` splits the file into shards as `llama-gguf-split` does
    (`dest` stem + `-00001-of-0000N.gguf`; the first shard's path is returned).
    `quantize(rows, type)`, where given, writes every matrix of a block type instead of
    `gguf.quants` and the packers below (meshd's own quantizer, ggml's reference rules).
    """
    config = json.loads((src / "config.json").read_text())
    family = config["model_type"]
    arch = arch or ARCH[family]
    writer = gguf.GGUFWriter(dest, arch, split_max_tensors=split_max_tensors)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _add_hparams(writer, src.name, config, arch, head_dim, rope, rope_type, sliding_window)
    _add_vocab(writer, src, config, pre)
    _add_metadata(writer, metadata or {})
    if rope_type == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, config, head_dim))

    weights = load_file(src / "model.safetensors")
    for name in sorted(weights, key=_tensor_order):
        if name.startswith("mtp."):
            continue  # llama.cpp's converter has no MTP heads for these architectures
        data = weights[name].float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads, heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, heads, kv_heads)
        target = gguf_name(name)
        chosen = (types or {}).get(target, tensor_type) if data.ndim == 2 else "F32"
        _add(writer, target, data, chosen, quantize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(dest)[0]


def _add_hparams(
    writer: gguf.GGUFWriter,
    name: str,
    config: Mapping[str, Any],
    arch: str,
    head_dim: int,
    rope: Mapping[str, Any],
    rope_type: str,
    sliding_window: bool,
) -> None:
    """The model's hyperparameters as the converter's `set_gguf_parameters` writes them."""
    heads = config["num_attention_heads"]
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    if config.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if sliding_window and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])


def _add_metadata(writer: gguf.GGUFWriter, metadata: Mapping[str, Any]) -> None:
    """`write_gguf`'s `metadata`: (value, GGUFValueType[, item type]) tuples as given, strings
    as strings, anything else as uint32."""
    for key, value in metadata.items():
        if isinstance(value, tuple):
            writer.add_key_value(key, *value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)


def _tensor_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[2]) if parts[1] == "layers" else -1, name)


def _add(
    writer: gguf.GGUFWriter,
    name: str,
    data: np.ndarray,
    tensor_type: str,
    quantize: Callable[[np.ndarray, Q], np.ndarray] | None = None,
) -> None:
    qtype = Q[tensor_type]
    if quantize is not None and qtype not in (Q.F32, Q.F16):
        blocks = quantize(data, qtype).reshape(data.shape[0], -1)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    elif qtype == Q.F32:
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    elif qtype in PACKERS:
        writer.add_tensor(name, PACKERS[qtype](data), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def llama3_rope_factors(rope: Mapping[str, Any], config: Mapping[str, Any], dim: int) -> np.ndarray:
    """The converter's `rope_freqs` (LlamaModel.generate_extra_tensors), as float32."""
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def write_vocab_gguf(src: pathlib.Path, dest: pathlib.Path, pre: str) -> pathlib.Path:
    """A GGUF holding only the byte-level BPE vocabulary of `src`'s tokenizer.json."""
    tok = json.loads((src / "tokenizer.json").read_text())
    size = len(tok["model"]["vocab"] | {a["content"]: a["id"] for a in tok["added_tokens"]})
    writer = gguf.GGUFWriter(dest, "llama")
    _add_vocab(writer, src, {"vocab_size": size}, pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def _add_vocab(
    writer: gguf.GGUFWriter, src: pathlib.Path, config: Mapping[str, Any], pre: str
) -> None:
    """Byte-level BPE as the converter's `_set_vocab_gpt2` writes it (no tokenizer.json: only
    the special ids of config.json, which the converter would also write)."""
    path = src / "tokenizer.json"
    if not path.is_file():
        gguf.SpecialVocab(src, n_vocab=config["vocab_size"]).add_to_gguf(writer, quiet=True)
        return
    tok = json.loads(path.read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    vocab |= {a["content"]: a["id"] for a in added.values()}
    by_id = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(config["vocab_size"]):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        token = by_id[i]
        if token in added:
            special = added[token]["special"]
            toktypes.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    gguf.SpecialVocab(src, load_merges=True).add_to_gguf(writer, quiet=True)


# --- K-quant packers: the inverse of gguf.quants' Q4_K/Q5_K/Q6_K dequantize_blocks ---------


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _scale_min_blocks(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block scale/min as 6-bit codes under f16 super-block d/dmin."""
    sub = x.reshape(-1, 8, 32)
    mins = np.maximum(0.0, -sub.min(-1))  # dequant subtracts dmin * m
    scales = (sub.max(-1) + mins) / levels
    d = _f16(scales.max(-1) / 63)
    dmin = _f16(mins.max(-1) / 63)
    safe_d = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    safe_m = np.where(dmin == 0, 1, dmin.astype(np.float32))[:, None]
    sc = np.clip(np.rint(scales / safe_d), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / safe_m), 0, 63).astype(np.uint8)
    eff_d = (d.astype(np.float32)[:, None] * sc)[..., None]
    eff_m = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.rint((sub + eff_m) / np.where(eff_d == 0, 1, eff_d)), 0, levels)
    return d, dmin, sc, mn, q.astype(np.uint8).reshape(-1, 256)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """12 bytes per block: `Q4_K.get_scale_min`'s layout (6-bit scales and mins)."""
    d_bytes = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m_bytes = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md_bytes = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d_bytes, m_bytes, md_bytes], axis=1).astype(np.uint8)


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """128 bytes: sub-block 2k in the low nibbles of bytes 32k.., 2k+1 in the high ones."""
    pairs = q.reshape(-1, 4, 2, 32) & 0x0F
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _rows(data: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    rows = data.reshape(-1, data.shape[-1]).astype(np.float32)
    assert rows.shape[1] % QK_K == 0, f"K-quants need rows of 256k values, got {rows.shape[1]}"
    return rows.reshape(-1, QK_K), (rows.shape[0], rows.shape[1] // QK_K)


def pack_q4_k(data: np.ndarray) -> np.ndarray:
    blocks, (n_rows, per_row) = _rows(data)
    d, dmin, sc, mn, q = _scale_min_blocks(blocks, 15)
    out = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_scales(sc, mn), _low_nibbles(q)], axis=1,
    )  # fmt: skip
    return out.reshape(n_rows, per_row * 144)


def pack_q5_k(data: np.ndarray) -> np.ndarray:
    blocks, (n_rows, per_row) = _rows(data)
    d, dmin, sc, mn, q = _scale_min_blocks(blocks, 31)
    high = (q.reshape(-1, 8, 32) >> 4) & 1  # sub-block j's bit 4 in bit j of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    out = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_scales(sc, mn), qh, _low_nibbles(q)], axis=1,
    )  # fmt: skip
    return out.reshape(n_rows, per_row * 176)


def pack_q6_k(data: np.ndarray) -> np.ndarray:
    blocks, (n_rows, per_row) = _rows(data)
    groups = blocks.reshape(-1, 16, 16)
    amax = np.abs(groups).max(-1)
    scales = amax / 31
    d = _f16(scales.max(-1) / 127)
    safe_d = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    sc = np.clip(np.rint(scales / safe_d), -128, 127).astype(np.int8)
    eff = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = np.clip(np.rint(groups / np.where(eff == 0, 1, eff)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 2, 64)  # [half][quarter of 64][position]
    ql = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    q4 = q.reshape(-1, 2, 4, 32)  # [half][group of 32][position]
    qh = (((q4 >> 4) & 3) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2)
    out = np.concatenate(
        [ql.astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8),
         d.view(np.uint8).reshape(-1, 2)], axis=1,
    )  # fmt: skip
    return out.reshape(n_rows, per_row * 210)


PACKERS = {Q.Q4_K: pack_q4_k, Q.Q5_K: pack_q5_k, Q.Q6_K: pack_q6_k}


def write_sentencepiece_gguf(src: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """The vocabulary as the converter's `_set_vocab_sentencepiece` writes it: pieces in id
    order, scores (a SentencePiece BPE piece scores minus its creation rank: here -id), types."""
    tok = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = sorted(vocab, key=vocab.__getitem__)
    writer = gguf.GGUFWriter(dest, "llama")
    tokens, scores, types = [], [], []
    for i, piece in enumerate(by_id):
        tokens.append(piece)
        if piece == "<unk>":
            kind, score = gguf.TokenType.UNKNOWN, 0.0
        elif piece in ("<s>", "</s>"):
            kind, score = gguf.TokenType.CONTROL, 0.0
        elif piece.startswith("<0x") and len(piece) == 6:
            kind, score = gguf.TokenType.BYTE, 0.0
        else:
            kind, score = gguf.TokenType.NORMAL, -float(i)
        types.append(kind)
        scores.append(score)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest
