"""GGUF tensors as stored: matrices and embedding tables over the file's mapped blocks.

A stage at quantization `gguf` never converts a GGUF weight: each tensor is a read-only view of
the memory-mapped file (pages shared with the page cache), multiplied by the block kernel of its
ggml type (`meshd.model.kernels.blocks`), which quantizes the activations per block as
llama.cpp does. So the stage computes what llama.cpp computes on the same file, to rounding,
and holds the file's bytes, not a copy of them.

A fused operand (q/k/v, gate/up) is its GGUF tensors side by side, each with its own type (a
Q4_K_M file stores v in Q6_K beside q and k in Q4_K). The runtime rotates adjacent pairs of q/k
dimensions (`rope.interleave_rope_dims`); where the file stores q/k rows in Hugging Face order
(qwen2, qwen3), the product's columns are reordered instead of the rows, which would be a copy.
"""

from __future__ import annotations

import ctypes

import torch

from meshd.model.kernels import MatrixArgs
from meshd.model.kernels.blocks import BlockMatrix

# `MatrixArgs.kind` of an operand of GGUF tensors (layers.c's `meshd_matrix`, kind 64).
BLOCKS_KIND = 64


class BlockPartArgs(ctypes.Structure):
    """layers.c's `meshd_block_part`: one GGUF tensor of a kind-64 operand."""

    _fields_ = [
        ("type", ctypes.c_int64),
        ("out", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("perm", ctypes.c_void_p),
    ]


class GgufMatrix:
    """The `[in, out]` operand made of GGUF tensors `[out_i, in]` as stored, side by side:
    `mm(x)` is `x @ w` for rows `x` `[T, in]`.

    `perms[i]`, where given, reorders part i's output columns (`y[:, perm]`).
    """

    kind = "gguf"

    def __init__(
        self, parts: list[BlockMatrix], perms: list[torch.Tensor | None] | None = None
    ) -> None:
        if not parts:
            raise ValueError("a GGUF matrix needs at least one tensor")
        in_features = parts[0].in_features
        if any(p.in_features != in_features for p in parts):
            raise ValueError("fused GGUF tensors must share their input width")
        self.parts = parts
        self.perms = perms if perms is not None else [None] * len(parts)
        self.in_features = in_features
        self.out_features = sum(p.out_features for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)
        self.kernel = parts[0].kernel
        self.types = tuple(p.ggml_type for p in parts)
        self._args: MatrixArgs | None = None
        self._parts: ctypes.Array[BlockPartArgs] | None = None
        self._library = parts[0].library
        if any(p.library is not self._library for p in parts):
            raise ValueError("fused GGUF tensors must share one block kernel path")

    def _part_args(self) -> ctypes.Array[BlockPartArgs]:
        """The parts as the block library's `meshd_blocks_parts_mm` reads them (and
        `meshd_layers`, kind 64); the arrays they point into live with `self`."""
        if self._parts is None:
            perms = [None if p is None else p.to(torch.int64).contiguous() for p in self.perms]
            self._perms = perms  # what the part arguments point into
            parts = (BlockPartArgs * len(self.parts))()
            for args, part, perm in zip(parts, self.parts, perms, strict=True):
                args.type, args.out = int(part.ggml_type), part.out_features
                args.data = part.data.ctypes.data
                args.perm = None if perm is None else perm.data_ptr()
            self._parts = parts
        return self._parts

    def args(self) -> MatrixArgs:
        """This operand as `meshd_layers` reads it (kind 64): its tensors' bytes, the column
        orders, and the block library's fused product; the arrays it points into live with
        `self`."""
        if self._args is None:
            parts = self._part_args()
            product = ctypes.cast(self._library.parts_mm, ctypes.c_void_p).value
            self._args = MatrixArgs(
                BLOCKS_KIND,
                self.in_features,
                self.out_features,
                len(self.parts),
                ctypes.addressof(parts),
                product,
            )
        return self._args

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [t, in] · the parts side by side → [t, out], in x's dtype: one call of the block
        library, which converts each row once for all parts of one vec_dot type."""
        rows = x if x.dtype == torch.float32 else x.float()
        if rows.dim() != 2 or rows.shape[1] != self.in_features:
            raise ValueError(f"expected [t, {self.in_features}], got {list(x.shape)}")
        rows = rows.contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        failed = self._library.parts_mm(
            ctypes.addressof(self._part_args()),
            len(self.parts),
            self.in_features,
            rows.data_ptr(),
            rows.shape[0],
            y.data_ptr(),
            self.out_features,
            None,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError(f"the block library refused a {self.types} product")
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The fp32 `[in, out]` matrix this stands for (tests and fallbacks)."""
        cols = []
        for part, perm in zip(self.parts, self.perms, strict=True):
            w = part.dequantize()  # [out_i, in]
            cols.append(w if perm is None else w[perm])
        return torch.cat(cols).t().contiguous()

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return torch.device("cpu")


# The operand a projection multiplies by: an `[in, out]` tensor or a block matrix.
Matrix = torch.Tensor | GgufMatrix


class GgufEmbedding:
    """An embedding table `[vocab, hidden]` as stored; a lookup dequantizes only its rows."""

    def __init__(self, table: BlockMatrix) -> None:
        self.table = table
        self.nbytes = table.nbytes

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` `[T]` as `[T, hidden]` in `dtype`."""
        rows = self.table.rows(ids.to(device="cpu", dtype=torch.int64))
        return rows if rows.dtype == dtype else rows.to(dtype)
