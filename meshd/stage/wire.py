"""Hidden states on the wire: torch tensors to and from `protocol.messages.TensorBlob`."""

from __future__ import annotations

import torch

from protocol.messages import DType, TensorBlob

TORCH_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}


def to_blob(tensor: torch.Tensor, dtype: DType) -> TensorBlob:
    """Serialise `tensor` as `dtype` (f32 for exactness tests, f16/bf16 to halve traffic)."""
    t = tensor.detach().to(device="cpu", dtype=TORCH_DTYPES[dtype]).contiguous()
    return TensorBlob(dtype, tuple(t.shape), t.view(torch.uint8).numpy().tobytes())


def from_blob(blob: TensorBlob) -> torch.Tensor:
    """A tensor over a copy of the blob's bytes (the caller moves it to its device/dtype)."""
    blob.validate()
    flat = torch.frombuffer(bytearray(blob.data), dtype=torch.uint8)
    return flat.view(TORCH_DTYPES[blob.dtype]).view(blob.shape)
