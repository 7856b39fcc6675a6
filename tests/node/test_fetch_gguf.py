"""A GGUF file over the mesh. Over real loopback lanes: a node fetches a Q8_0 GGUF file's
manifest files and one stage's tensors from a holder of the file, and that stage computes
exactly what the same stage of the file computes, while the node holds no other layer's bytes.
With real daemons: a holder of the GGUF file and a `mesh:ID` node answer the greedy tokens one
process decodes from the file (served as stored, `auto`); a `mesh:ID` node
started a second after the first start of a holder of a large file (hashing it takes seconds)
waits for it and serves its stage."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from meshd.bench.fetch import artifact_nodes
from meshd.bench.gguf_writer import write_gguf
from meshd.bench.single_node import generate
from meshd.cli.supervisor import agreed_plan, kill_all, stage_budget, started
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.gguf_checkpoint import GGUFCheckpoint
from meshd.model.gguf_mesh import GGUFStoreCheckpoint
from meshd.model.manifest import ModelStore, store_checkpoint
from meshd.model.stage import StageModel
from meshd.node.fetch import stage_tensor_names
from meshd.node.fetch_run import FetchRun
from protocol.artifacts import ArtifactKind, FetchConfig, Fetcher, open_manifest
from tests.node.daemons import SECRET, Daemon, loopback
from tests.node.test_fetch_mesh import _tokens

HOLDER_PORT = 17461
LARGE_HOLDER_PORT = 17463
CONFIG = FetchConfig(chunk_bytes=64 * 1024, window_bytes=256 * 1024, timeout_s=5.0)


async def _fetch_files_then_layers_2_4(
    holder: GGUFCheckpoint, store: ModelStore
) -> GGUFStoreCheckpoint:
    """Over loopback lanes from a node holding `holder`: the manifest's files, then layers
    [2, 4)'s tensors, as a planned node fetches them; the store's checkpoint after."""
    model_id, manifest = store.model_id, store.manifest
    async with artifact_nodes([holder, holder], CONFIG) as (source, fetching):
        for wanted in (store.file_indices(), None):
            if wanted is None:  # then one stage's tensors
                stage = store_checkpoint(store)
                assert isinstance(stage, GGUFStoreCheckpoint) and not stage.tensors
                wanted = store.tensor_indices(stage_tensor_names(stage.config, 2, 4))
            fetcher = Fetcher(model_id, manifest, wanted, CONFIG)
            run = FetchRun(fetcher, store, fetching.service._send, lambda: [source.key])
            fetching.service._run = run
            await run.run()
    stage.refresh()
    return stage


def _layers_2_4(ours: GGUFStoreCheckpoint, theirs: GGUFCheckpoint) -> bool:
    """Whether layers [2, 4) loaded from both compute the same bits (q8_0)."""
    stages = [StageModel.load(c, 2, 4, quantization="q8_0") for c in (ours, theirs)]
    hidden = torch.randn(4, theirs.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for s in stages:
        s.open_session("s", 8)
    outs = [s.forward("s", 0, hidden).hidden for s in stages]
    return torch.equal(outs[0], outs[1])


async def test_a_stage_of_a_fetched_gguf_file_computes_as_the_file(tmp_path: pathlib.Path) -> None:
    path = write_gguf(builtin_model_dir(), tmp_path / "tiny-q8.gguf", "Q8_0")
    holder = open_checkpoint(path)
    assert isinstance(holder, GGUFCheckpoint)
    model_id, data, manifest = holder.manifest
    assert holder.model_id == model_id == open_manifest(data, model_id)[0]
    assert manifest.format == "gguf"
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    stage = await _fetch_files_then_layers_2_4(holder, store)
    assert set(stage.tensors) == set(stage_tensor_names(stage.config, 2, 4))
    # The skeleton holds the header; the layers' bytes are holes (no disk).
    skeleton = stage.directory
    assert skeleton.stat().st_size >= path.stat().st_size
    assert os.stat(skeleton).st_blocks * 512 < path.stat().st_size // 2
    assert stage.config == holder.config and stage.default_quantization == "gguf"
    assert _layers_2_4(stage, holder)
    # The tokenizer comes from the header's metadata.
    text = "Once upon a time"
    assert open_tokenizer(skeleton).encode(text) == open_tokenizer(path).encode(text)
    tensors = [i for i, a in enumerate(manifest.artifacts) if a.kind == ArtifactKind.TENSOR]
    assert store.held(tensors) == set(store.tensor_indices(stage_tensor_names(stage.config, 2, 4)))


def _split_model(directory: pathlib.Path) -> list[pathlib.Path]:
    """The built-in model as Q8_0 shards, as llama-gguf-split writes them."""
    first = write_gguf(builtin_model_dir(), directory / "m.gguf", "Q8_0", split_max_tensors=16)
    shards = sorted(directory.glob("m-*-of-*.gguf"))
    assert first == shards[0] and len(shards) > 2
    return shards


async def test_a_split_gguf_model_is_fetched_shard_by_shard(tmp_path: pathlib.Path) -> None:
    # Large models come as llama-gguf-split shards: every shard's header travels, each weight
    # from the shard holding it, and the fetching node's skeleton shards open as the model.
    shards = _split_model(tmp_path)
    first = shards[0]
    holder = open_checkpoint(shards[-1])  # any shard names the model
    assert isinstance(holder, GGUFCheckpoint)
    model_id, data, manifest = holder.manifest
    assert holder.model_id == model_id == open_checkpoint(shards[0]).model_id
    headers = [a.name for a in manifest.artifacts if a.name.startswith("gguf.header")]
    assert sorted(headers) == ["gguf.header"] + [
        f"gguf.header.{k}" for k in range(2, len(shards) + 1)
    ]
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    stage = await _fetch_files_then_layers_2_4(holder, store)
    assert stage.directory.name == f"model-00001-of-{len(shards):05d}.gguf"
    assert len(list(stage.directory.parent.glob("model-*-of-*.gguf"))) == len(shards)
    assert _layers_2_4(stage, holder)
    text = "Once upon a time"
    assert open_tokenizer(stage.directory).encode(text) == open_tokenizer(first).encode(text)


@pytest.mark.slow
def test_mesh_id_nodes_serve_a_gguf_files_stages_like_one_process(tmp_path: pathlib.Path) -> None:
    model = write_gguf(builtin_model_dir(), tmp_path / "tiny-stories-q8.gguf", "Q8_0")
    checkpoint = open_checkpoint(model)
    budget = stage_budget(str(model), 2)  # two nodes hold it, one cannot
    holder = Daemon(
        tmp_path,
        61,
        secret=SECRET,
        budget=budget,
        extra=("--model", str(model), "--listen-port", str(HOLDER_PORT)),
    )
    join = ("--join", f"{loopback(61)}:{HOLDER_PORT}")
    fetch = (*join, "--model", f"mesh:{checkpoint.model_id[:16]}")
    daemons = [holder, Daemon(tmp_path, 62, secret=SECRET, budget=budget, extra=fetch)]
    try:
        started(daemons, timeout_s=120)
        plan = agreed_plan(daemons, timeout_s=120, stable_s=1.0)
        assert len(plan) == 2, plan
        prompt = open_tokenizer(model).encode("Once upon a time")
        whole = StageModel.load(
            checkpoint, 0, checkpoint.config.num_layers, device="cpu", quantization="gguf"
        )
        previous = torch.get_num_threads()
        torch.set_num_threads(1)  # the daemons hold the cores
        try:
            expected = generate([whole], prompt, 24).tokens
        finally:
            torch.set_num_threads(previous)
        for d in daemons:
            assert _tokens(d, prompt) == expected, d.name
        status = daemons[1].status()
        assert status["model_id"] == checkpoint.model_id and status["fetch"]["state"] == "done"
        lo, hi = status["stage_layers"]
        stored = daemons[1].state / "models" / checkpoint.model_id / "tensors"
        wanted = {f"{n}.bin" for n in stage_tensor_names(checkpoint.config, lo, hi)}
        assert wanted <= {p.name for p in stored.iterdir()}
        models = httpx.get(f"{daemons[1].api_url}/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny-stories-q8"]
    finally:
        kill_all(daemons)


def _large_model(directory: pathlib.Path) -> pathlib.Path:
    """A GGUF file of about 235 MB (the built-in model's vocabulary, wider and deeper layers,
    random float32 weights): hashing it takes seconds."""
    source = builtin_model_dir()
    directory.mkdir()
    config = json.loads((source / "config.json").read_text())
    config.update(
        hidden_size=512,
        intermediate_size=4096,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=8,
        num_nextn_predict_layers=0,
    )
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)
    hidden, inner, kv = 512, 4096, 4 * 64
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    weights = {
        "model.embed_tokens.weight": weight(config["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights |= {
            layer + "input_layernorm.weight": torch.ones(hidden),
            layer + "post_attention_layernorm.weight": torch.ones(hidden),
            layer + "self_attn.q_proj.weight": weight(hidden, hidden),
            layer + "self_attn.k_proj.weight": weight(kv, hidden),
            layer + "self_attn.v_proj.weight": weight(kv, hidden),
            layer + "self_attn.o_proj.weight": weight(hidden, hidden),
            layer + "mlp.gate_proj.weight": weight(inner, hidden),
            layer + "mlp.up_proj.weight": weight(inner, hidden),
            layer + "mlp.down_proj.weight": weight(hidden, inner),
        }
    save_file(weights, str(directory / "model.safetensors"))
    return write_gguf(directory, directory.parent / "large.gguf", "F32")


@pytest.mark.slow
def test_a_fetcher_started_right_after_its_holder_waits_for_it_and_serves_its_stage(
    tmp_path: pathlib.Path,
) -> None:
    # The holder's first start hashes its file (seconds; nothing is cached in its state dir),
    # then loads and re-plans; the fetcher, started a second after it, keeps asking all the
    # while (its chunk timeout is short, so a holder that is busy for several of them would
    # have been struck out), and serves its stage of the two-stage plan.
    model = _large_model(tmp_path / "large")
    assert model.stat().st_size > 200_000_000
    model_id = open_checkpoint(model).model_id
    budget = stage_budget(str(model), 2)
    holder = Daemon(
        tmp_path,
        63,
        secret=SECRET,
        budget=budget,
        extra=("--model", str(model), "--listen-port", str(LARGE_HOLDER_PORT)),
    )
    daemons = [holder]
    try:
        time.sleep(1.0)
        join = ("--join", f"{loopback(63)}:{LARGE_HOLDER_PORT}")
        fetch = (*join, "--model", f"mesh:{model_id[:16]}")
        timeout = ("--fetch-timeout-s", "1")
        daemons.append(Daemon(tmp_path, 64, secret=SECRET, budget=budget, extra=(*fetch, *timeout)))
        started(daemons, timeout_s=60)
        plan = agreed_plan(daemons, timeout_s=60, stable_s=1.0)
        assert len(plan) == 2, plan
        status = daemons[1].status()
        assert status["fetch"]["state"] == "done", status["fetch"]
        assert status["stage_layers"] is not None
        events = status["events"]
        assert not [e for e in events if e["kind"] == "fetch-failed"], events
        prompt = open_tokenizer(model).encode("Once upon a time")
        for d in daemons:
            assert len(_tokens(d, prompt)) == 24, d.name
        assert all(d.proc.poll() is None for d in daemons)
    finally:
        kill_all(daemons)
