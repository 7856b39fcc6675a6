"""How a stage holds its matrices: the quantization names, and the bytes each holds.

`none` keeps the checkpoint's matrices in the stage's dtype. Every other scheme is one of
ggml's block formats, run by the block kernels (`meshd.model.kernels.blocks`): `gguf` is a
GGUF file's tensors as stored (`meshd.model.gguf_matrix`), and the block quantizations
(`BLOCK_QUANTIZATIONS`) quantize a checkpoint at load into the blocks llama-quantize would
write, so one path runs both. `int8` and `int4` are aliases (`ALIASES`).
"""

from __future__ import annotations

import torch

from meshd.model.gguf_matrix import GgufMatrix, Matrix

BLOCK_QUANTIZATIONS: tuple[str, ...] = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
QUANTIZATIONS: tuple[str, ...] = ("none", "gguf", *BLOCK_QUANTIZATIONS)
# Older names, accepted wherever a quantization is named: int8 (per-channel int8 weights) is
# q8_0, int4 (4-bit groups) q4_k, the 4-bit format that keeps the most of the model
# (docs/configuration.md has the figures).
ALIASES: dict[str, str] = {"int8": "q8_0", "int4": "q4_k"}
# Every name a user may give: the schemes and their aliases.
NAMES: tuple[str, ...] = (*QUANTIZATIONS, *ALIASES)


def check_quantization(quantization: str) -> str:
    """The scheme `quantization` names (an alias resolved), else ValueError listing them."""
    if quantization in ALIASES:
        return ALIASES[quantization]
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(NAMES)}, got {quantization!r}")
    return quantization


def matmul(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    """`x @ w` for a plain or a block matrix."""
    if isinstance(w, GgufMatrix):
        return w.mm(x)
    return torch.mm(x, w)


def in_features(w: Matrix) -> int:
    """Rows of the `[in, out]` operand a plain or block matrix stands for."""
    return w.in_features if isinstance(w, GgufMatrix) else int(w.shape[0])


def row_exact(quantization: str, device: torch.device) -> bool:
    """Whether this stage's matrices give a row the same bits in any batch (tested): every
    block kernel computes each row on its own. Not MKL's fp32 product."""
    return device.type == "cpu" and quantization != "none"


def matrix_bytes(in_features: int, out_features: int, quantization: str, dtype: torch.dtype) -> int:
    """Bytes one `[in, out]` matrix holds at `quantization` (`none` or a block quantization)."""
    if quantization == "gguf":
        raise ValueError("a gguf matrix holds its tensors' bytes in the file: ask the checkpoint")
    if quantization == "none":
        return in_features * out_features * _itemsize(dtype)
    return out_features * block_row_bytes(block_type(quantization, in_features), in_features)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# --- ggml block formats, quantized at load ------------------------------------------------
#
# A checkpoint at a block quantization holds what llama-quantize would write for the same
# choice (llama_tensor_get_type, without an importance matrix), so the stage is the GGUF file
# that tool makes, run by the same kernels as a GGUF file run as stored:
# - matrices: the named type; a row width that K-quant super-blocks (256) do not divide takes
#   llama-quantize's fallback (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and a width that
#   blocks of 32 do not divide takes F16;
# - the head (output.weight): Q6_K for every type but q8_0 (Q8_0), as llama-quantize keeps it;
# - the embedding: the matrices' type, except that a tied embedding is the head (one tensor, as
#   llama-quantize gives token_embd the head's type when the file has no output.weight).
# Unlike a Q4_K_M file, q4_k does not move some layers' v and down matrices to Q6_K: every layer
# holds the same bytes, so the planner's per-layer figure is exact.

_BLOCK_TYPE = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# (elements, bytes) of one block (ggml's type traits).
_BLOCK_SIZE = {
    "F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}  # fmt: skip


def _fits(name: str, in_features: int) -> str:
    """`name`, or the type llama-quantize falls back to where its blocks do not divide a row."""
    if name in _K_FALLBACK and in_features % 256:
        name = _K_FALLBACK[name]
    return name if in_features % _BLOCK_SIZE[name][0] == 0 else "F16"


def block_type(quantization: str, in_features: int, role: str = "matrix") -> str:
    """The ggml type (its name) a matrix with rows of `in_features` takes at block quantization
    `quantization`: `role` "matrix" (a layer's), "head", or "embedding" (an untied table)."""
    name = _BLOCK_TYPE[quantization]
    if role == "head" and quantization != "q8_0":
        name = "Q6_K"
    return _fits(name, in_features)


def block_row_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one row of `in_features` elements in ggml type `type_name`."""
    elements, nbytes = _BLOCK_SIZE[type_name]
    return in_features // elements * nbytes


def block_table_bytes(vocab: int, hidden: int, quantization: str, tied: bool) -> tuple[int, int]:
    """(embedding table, untied head) bytes at a block quantization; a tied head is the table."""
    head = vocab * block_row_bytes(block_type(quantization, hidden, "head"), hidden)
    if tied:
        return head, 0
    table = vocab * block_row_bytes(block_type(quantization, hidden, "embedding"), hidden)
    return table, head
