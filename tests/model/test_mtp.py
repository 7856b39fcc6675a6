"""MTP depths with incremental positional KV equal a full recomputation of the formula."""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from torch import nn

from meshd.bench.checkpoints import add_mtp, make_checkpoint
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import InvalidInput
from meshd.model.stage import StageModel

TOKENS = [1, 30, 31, 200, 7, 7, 99, 150, 3, 64, 65, 12, 240, 18]
DEPTH = 2


class ReferenceDepth(nn.Module):
    """The written-down formula with transformers' own layers, over a whole sequence."""

    def __init__(self, config: transformers.LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = transformers.models.llama.modeling_llama.LlamaRMSNorm(h, config.rms_norm_eps)
        self.hnorm = transformers.models.llama.modeling_llama.LlamaRMSNorm(h, config.rms_norm_eps)
        self.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
        self.rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        self.load_state_dict(weights, strict=False)

    def forward(self, embeds: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev)), dim=-1))[None]
        positions = torch.arange(x.shape[1])[None]
        # No mask with sdpa means causal attention over the whole sequence.
        out = self.block(x, position_embeddings=self.rotary(x, positions), position_ids=positions)
        return out[0]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("mtp")
    model = make_checkpoint(directory, "llama", seed=8)
    add_mtp(directory, model, DEPTH, seed=9)
    return directory


def reference(directory: pathlib.Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per depth: hidden `[N-d, H]` and logits `[N-d, V]` by full recomputation."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    config = model.config
    config._attn_implementation = "sdpa"
    mtp = Checkpoint.open(directory)
    captured: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.append(o[0]))
    tokens = torch.tensor(TOKENS)
    hiddens, logits = [], []
    with torch.no_grad():
        model(tokens[None])
        hook.remove()
        prev = captured[0]  # main model's last-layer residual, before the final norm
        embed = model.model.embed_tokens
        for k in range(DEPTH):
            weights = dict(mtp.load(n for n in mtp.tensors if n.startswith(f"mtp.{k}.")))
            depth = ReferenceDepth(config, {n[len(f"mtp.{k}.") :]: t for n, t in weights.items()})
            n = len(TOKENS) - (k + 1)
            h = depth(embed(tokens[k + 1 : k + 1 + n]), prev[:n])
            hiddens.append(h)
            logits.append(model.lm_head(depth.norm(h)))
            prev = h
    return hiddens, logits


def test_mtp_incremental_equals_full_recomputation(mtp_dir: pathlib.Path) -> None:
    ref_hidden, ref_logits = reference(mtp_dir)
    checkpoint = Checkpoint.open(mtp_dir)
    first, last = StageModel.load(checkpoint, 0, 2), StageModel.load(checkpoint, 2, 4)
    assert len(last.mtp) == DEPTH and not first.mtp
    tokens = torch.tensor(TOKENS)
    for s in (first, last):
        s.open_session("s", len(TOKENS))
    # Main model in windows (a chunk then single steps), MTP depths fed as a decoder would.
    windows = [(0, 6), (6, 9), *[(p, p + 1) for p in range(9, len(TOKENS))]]
    main = torch.cat(
        [last.forward("s", a, first.forward("s", a, tokens[a:b]).hidden).hidden for a, b in windows]
    )
    prev = main
    for depth in range(1, DEPTH + 1):
        n = len(TOKENS) - depth
        outs = []
        for a, b in windows:
            b = min(b, n)
            if a >= b:
                continue
            if depth == 1 and a == 6:
                # A rejected speculative window first: its KV must be overwritten, not read.
                last.mtp_forward("s", depth, a, torch.randn(5, 64), tokens[:5])
            outs.append(last.mtp_forward("s", depth, a, prev[a:b], tokens[a + depth : b + depth]))
        hidden = torch.cat([o.hidden for o in outs])
        logits = torch.cat([o.logits for o in outs])
        # fp32 rounding only: another summation order moves values of ~8 by ~1e-5; a wrong
        # KV read or position would move them by O(1).
        assert torch.allclose(hidden, ref_hidden[depth - 1], atol=1e-5, rtol=1e-5)
        assert torch.allclose(logits, ref_logits[depth - 1], atol=1e-5, rtol=1e-5)
        prev = hidden


def test_mtp_errors(mtp_dir: pathlib.Path) -> None:
    checkpoint = Checkpoint.open(mtp_dir)
    first, last = StageModel.load(checkpoint, 0, 2), StageModel.load(checkpoint, 2, 4)
    for s in (first, last):
        s.open_session("s", 8)
    with pytest.raises(InvalidInput, match="last stage"):
        first.mtp_forward("s", 1, 0, torch.zeros(1, 64), torch.tensor([1]))
    with pytest.raises(InvalidInput, match="depth 3"):
        last.mtp_forward("s", 3, 0, torch.zeros(1, 64), torch.tensor([1]))
    with pytest.raises(InvalidInput, match="2 hidden states but 1"):
        last.mtp_forward("s", 1, 0, torch.zeros(2, 64), torch.tensor([1]))
    # MTP KV is counted in the stage's per-token KV size (2 main layers + 2 depths).
    assert last.kv_bytes_per_token == 2 * first.kv_bytes_per_token
