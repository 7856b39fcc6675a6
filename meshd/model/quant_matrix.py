"""What a quantized matrix is: `QuantMatrix` (`mm(x)` stands for `x @ w`), `Matrix` (the operand a
projection multiplies by: a tensor or a `QuantMatrix`), and `VnniMatrix`, the base of the
matrices meshd's own x86 kernels run.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from meshd.model.kernels import MatrixArgs

# The least half-range of a row (a constant row's), as an fp32 value.
TINY = struct.unpack("f", struct.pack("f", 1e-30))[0]


class QuantMatrix:
    """A quantized `[in, out]` matrix: `mm(x)` is `x @ w` for rows `x` `[T, in]`."""

    kind = ""  # "int8" or "int4"
    kernel = ""  # which kernel runs it (for reports)
    in_features: int
    out_features: int
    nbytes: int  # bytes held, padding included

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w` in `x`'s dtype."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The fp32 `[in, out]` matrix this stands for (tests and fallbacks)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        raise NotImplementedError


Matrix = torch.Tensor | QuantMatrix


class VnniMatrix(QuantMatrix):
    """A matrix run by meshd's own x86 kernels (`kernels/quant_mm.c`): int8 or int4 weights,
    each row of activations quantized to uint8 over its own range in the kernel, so a row's
    result has the same bits in any batch (verify windows compute the bits of plain decoding).
    A call can also RMS-norm or SwiGLU-gate its input and add a residual (`mm_add`)."""

    _fn: Any  # the kernel's entry point
    _packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, sums
    _layout: int  # the padded input (int8) or the group size (int4)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm_add(x, None)

    def mm_add(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        out: torch.Tensor | None = None,
        glu: bool = False,
    ) -> torch.Tensor:
        """`x @ w (+ residual)`, the residual added in the kernel (`[T, out]`, x's dtype).

        With `norm` (fp32 `[in]`), `x` is first RMS-normed in the kernel with that weight and
        `eps` (the pre-norm of a projection, without a torch operation of its own). With `glu`,
        `x` is `[T, 2 * in]`, gate then up, and the kernel multiplies silu(gate) * up (the
        input of a SwiGLU down projection). `out`: an fp32 `[T, out]` contiguous tensor to
        write into.
        """
        rows = x.float().contiguous()
        if out is None or out.dtype != torch.float32 or not out.is_contiguous():
            out = torch.empty(rows.shape[0], self.out_features)
        res = None if residual is None else residual.float().contiguous()
        codes, scales, sums = self._packed
        failed = self._fn(
            rows.data_ptr(),
            rows.shape[0],
            self.in_features,
            codes.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
            self.out_features,
            self._layout,
            out.data_ptr(),
            None if res is None else res.data_ptr(),
            None if norm is None else norm.data_ptr(),
            eps,
            int(glu),
            TINY,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("meshd's quantized kernel could not allocate its row buffers")
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def args(self) -> MatrixArgs:
        """This matrix as the kernel's `meshd_matrix` (pointers into tensors it keeps)."""
        codes, scales, sums = self._packed
        return MatrixArgs(
            8 if self.kind == "int8" else 4,
            self.in_features,
            self.out_features,
            self._layout,
            codes.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
        )
