"""Fused GGUF operands (q/k/v, gate/up: several tensors against one input) in one call of the
block library, and the activation quantizer it shares between them: each tensor's columns are
the bits of its own product, on every kernel path, batch and thread count, and the activation
codes are those llama.cpp's CPU backend makes, ties and all."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from meshd.bench.llamacpp_q8 import q8_0_bytes
from meshd.model.gguf_matrix import GgufMatrix
from meshd.model.kernels.blocks import (
    BlockMatrix,
    supported_types,
)


def _matrix(qtype: T, n_out: int, k: int, rng: np.random.Generator) -> BlockMatrix:
    if qtype == T.Q6_K:  # gguf.quants cannot quantize K types: random blocks, sane fp16 scales
        raw = rng.integers(0, 256, size=(n_out * k // 256, 210), dtype=np.uint8)
        scale = (rng.random(raw.shape[0]) * np.float32(0.01)).astype(np.float16)
        raw[:, 208:210] = scale.view(np.uint8).reshape(-1, 2)
        return BlockMatrix(raw.reshape(-1), qtype, k, n_out)
    w = rng.standard_normal((n_out, k)).astype(np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(-1)
    return BlockMatrix(raw, qtype, k, n_out)


# q/k/v-like operands: one format throughout (SmolLM2's Q4_1, a Q4_0 file), and a Q4_K_M-like
# mix whose parts need different activations (Q8_1, Q8_0, Q8_K, fp16).
_OPERANDS = {
    "Q4_1x3": (T.Q4_1, T.Q4_1, T.Q4_1),
    "Q4_0x2": (T.Q4_0, T.Q4_0),
    "mixed": (T.Q4_1, T.Q8_0, T.Q6_K, T.F16, T.Q5_0),
}


@pytest.mark.parametrize("name", list(_OPERANDS))
def test_a_fused_operand_gives_each_tensors_own_bits(path: str, name: str, threads: None) -> None:
    types = _OPERANDS[name]
    if not set(types) <= supported_types():
        pytest.skip("a part's type has no kernel in this installation")
    rng = np.random.default_rng(len(name))
    k = 512
    widths = (64, 37, 16, 45, 600)[: len(types)]  # 600 x 512 Q5_0: large enough to split
    parts = [_matrix(q, n, k, rng) for q, n in zip(types, widths, strict=True)]
    # Columns of the first part in another order (what a qwen2 file's q/k products get).
    perms: list[torch.Tensor | None] = [torch.randperm(widths[0])] + [None] * (len(types) - 1)
    fused = GgufMatrix(parts, perms)
    x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
    for n in (1, 2):
        torch.set_num_threads(n)
        for t in (1, 3, 17, 70):
            rows = x[:t]
            expected = torch.cat(
                [p.mm(rows)[:, perm] if perm is not None else p.mm(rows) for p, perm in
                 zip(parts, perms, strict=True)],
                dim=1,
            )  # fmt: skip
            assert torch.equal(fused.mm(rows), expected), (n, t)


def test_activation_codes_are_llamacpps_ties_included(path: str) -> None:
    """A Q8_0 identity times x gives each activation's code times its block scale, so the
    product shows the codes: they must be the ones llama.cpp's x86 quantize_row_q8_0 makes
    (q = round(x * (127 / amax)), ties to even), not gguf's reference ones (ties away)."""
    k = 256
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, k)).astype(np.float32)
    # Blocks whose amax is 127 (127 / amax = 1): every x below is a tie, k + 0.5 or -(k + 0.5).
    ties = (rng.integers(-120, 120, size=(4, 32)) + 0.5).astype(np.float32)
    ties[:, 0] = 127.0
    ties[0, 1:4] = [2.5, -3.5, 0.5]  # to 2, -4 and 0 (ties away would give 3, -4 and 1)
    x[:, 32:64] = ties
    x[1, 64:96] = 0.0  # an all-zero block: d = 0, codes 0
    x[2, 96:128] *= np.float32(1e-30)  # tiny but normal values
    eye = np.ascontiguousarray(gguf.quants.quantize(np.eye(k, dtype=np.float32), T.Q8_0))
    w = BlockMatrix(eye.view(np.uint8).reshape(-1), T.Q8_0, k, k)
    got = w.mm(torch.from_numpy(x)).numpy()
    ref = q8_0_bytes(x)
    codes = ref[:, :, 2:].copy().view(np.int8).astype(np.float32).reshape(4, k)
    assert list(codes[0, 33:36]) == [2.0, -4.0, 0.0]
    assert (codes[:, 32:64] % 2 == 0)[:, 1:].all()  # every tie went to the even neighbour
    d_x = np.repeat(ref[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32), 32, 1)
    d_w = np.float32(1 / 127)  # the identity's scale: fp16(1 / 127) is what its blocks hold
    d_w = np.float32(np.float16(d_w))
    expected = (np.float32(127) * codes) * (d_w * d_x)
    assert np.array_equal(got, expected)
