"""The built-in model shipped in meshd/model/builtin: format contract, offline load, quality."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import sysconfig
from importlib import resources
from pathlib import Path
from types import ModuleType

import jinja2
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

BUILTIN = Path(str(resources.files("meshd.model") / "builtin"))
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "training_info.json",
)
# A loop of period p tokens has a distinct 4-gram ratio of about p/61 over 64 tokens, so 0.5
# rejects any cycle shorter than ~30 tokens; ordinary code scores 0.8-1.0.
MIN_DISTINCT_4GRAM_RATIO = 0.5

OFFLINE_GENERATE = r"""
import json, socket, sys
def refuse(*args, **kwargs):
    raise OSError("network is unreachable in this test")
socket.socket.connect = refuse
socket.getaddrinfo = refuse
socket.create_connection = refuse
import torch
from transformers import AutoTokenizer, LlamaForCausalLM
torch.set_num_threads(1)
path, prompt = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(path)
model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = tok(prompt, return_tensors="pt").input_ids
out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                     max_new_tokens=64, min_new_tokens=64)
new = out[0, ids.shape[1]:].tolist()
print(json.dumps({"ids": new, "text": tok.decode(new)}))
"""


def _train_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_builtin", SCRIPTS / "train_builtin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_builtin"] = module
    spec.loader.exec_module(module)
    return module


def _eval_module() -> ModuleType:
    _train_module()  # eval_builtin imports it by name
    spec = importlib.util.spec_from_file_location("eval_builtin", SCRIPTS / "eval_builtin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["eval_builtin"] = module
    spec.loader.exec_module(module)
    return module


def _config() -> dict[str, object]:
    return json.loads((BUILTIN / "config.json").read_text())


def distinct_4gram_ratio(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(1, len(grams))


def test_shipped_directory_is_complete_and_small() -> None:
    assert BUILTIN.is_dir()
    for name in REQUIRED:
        assert (BUILTIN / name).is_file(), name
    total = sum(f.stat().st_size for f in BUILTIN.iterdir() if f.is_file())
    assert total <= 25 * 1024 * 1024
    config = _config()
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_nextn_predict_layers"] in (2, 3)


def test_weights_carry_mtp_depths_under_the_agreed_names() -> None:
    config = _config()
    hidden = config["hidden_size"]
    with safe_open(str(BUILTIN / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for k in range(int(config["num_nextn_predict_layers"])):  # type: ignore[call-overload]
            assert f.get_slice(f"mtp.{k}.eh_proj.weight").get_shape() == [hidden, 2 * hidden]
            for part in ("enorm", "hnorm", "norm", "block.input_layernorm"):
                assert f"mtp.{k}.{part}.weight" in names
            for proj in ("q", "k", "v", "o"):
                assert f"mtp.{k}.block.self_attn.{proj}_proj.weight" in names
            for proj in ("gate", "up", "down"):
                assert f"mtp.{k}.block.mlp.{proj}_proj.weight" in names
    assert "model.embed_tokens.weight" in names
    assert f"model.layers.{config['num_hidden_layers']}.input_layernorm.weight" not in names


def test_tokenizer_round_trips_python_exactly() -> None:
    tok = Tokenizer.from_file(str(BUILTIN / "tokenizer.json"))
    snippet = 'def área(r: float) -> float:\n\treturn 3.14159 * r ** 2  # π r²\n\n\n  x = "\\n"  \n'
    assert tok.decode(tok.encode(snippet).ids, skip_special_tokens=False) == snippet
    for special in ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        assert len(tok.encode(special).ids) == 1, special


def test_chat_template_renders_roles_and_generation_prompt() -> None:
    tok_config = json.loads((BUILTIN / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(tok_config["chat_template"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add two numbers."},
    ]
    text = template.render(messages=messages, add_generation_prompt=True)
    assert text == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nAdd two numbers.<|end|>\n<|assistant|>\n"
    )
    assert not template.render(messages=messages, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    generation = json.loads((BUILTIN / "generation_config.json").read_text())
    tok = Tokenizer.from_file(str(BUILTIN / "tokenizer.json"))
    assert tok.token_to_id("<|end|>") in generation["eos_token_id"]
    assert tok.token_to_id(tok_config["eos_token"]) in generation["eos_token_id"]


@functools.cache
def _offline_greedy_continuation() -> dict[str, object]:
    """64 greedy tokens from the shipped model, loaded by transformers with no network."""
    prompt = 'def read_lines(path):\n    """Return the lines of the file at path."""\n'
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_GENERATE, str(BUILTIN), prompt],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_loads_offline_with_transformers_and_generates() -> None:
    result = _offline_greedy_continuation()
    assert isinstance(result["ids"], list)
    assert len(result["ids"]) == 64


def test_greedy_code_continuation_does_not_loop() -> None:
    # One code prompt, 64 tokens; the 200-token loop rate over held-out prompts is checked
    # below and reported in docs/model.md.
    result = _offline_greedy_continuation()
    assert isinstance(result["ids"], list)
    assert distinct_4gram_ratio(result["ids"]) > MIN_DISTINCT_4GRAM_RATIO, result["text"]


def test_mtp_depth_one_agrees_with_the_main_model_on_stdlib_code() -> None:
    import torch

    ev = _eval_module()
    torch.set_num_threads(1)
    model, tok, _ = ev.load_builtin(BUILTIN)
    info = json.loads((BUILTIN / "training_info.json").read_text())
    held_out = Path(sysconfig.get_paths()["stdlib"]) / info["heldout_files"][0]
    ids = tok.encode(held_out.read_text()).ids[: 128 + 1 + len(model.mtp)]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    greedy = logits[0].argmax(-1)[0]
    draft = logits[1].argmax(-1)[0]
    agreement = (draft[:-1] == greedy[1:]).float().mean().item()
    # An untrained depth agrees ~1/vocab of the time; a useful draft head, far more often.
    assert agreement > 0.25


@pytest.mark.slow
def test_training_is_reproducible_from_the_seed(tmp_path: Path) -> None:
    import dataclasses

    tb = _train_module()
    tb.train(tb.TINY, tmp_path / "a", quiet=True)
    tb.train(tb.TINY, tmp_path / "b", quiet=True)
    tb.train(dataclasses.replace(tb.TINY, seed=7), tmp_path / "c", quiet=True)
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in "abc"]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_unlikelihood_marks_only_generated_tokens_that_repeat_an_ngram() -> None:
    import torch

    tb = _train_module()
    # prompt [1 2 3], then the model "generated" 1 2 3 1 2 9: the second "1 2" after the
    # prompt and the "2 3" repeated from the prompt complete seen bigrams; 9 is new.
    seqs = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 9]])
    mask = tb.repeated_ngram_mask(seqs, prompt_tokens=3, n=2)
    assert mask[0].tolist() == [False, False, False, False, True, True, True, True, False]
    # Phase 3: copying the prompt's bigrams is allowed; the model repeating its own is not.
    # Generated bigrams: (3,1) (1,2) (2,3) (3,1) (1,2) (2,9): the second (3,1) and (1,2).
    mine = tb.repeated_ngram_mask(seqs, prompt_tokens=3, n=2, prompt_counts=False)
    assert mine[0].tolist() == [False, False, False, False, False, False, True, True, False]


def test_unlikelihood_can_let_a_span_come_back_once_and_mark_the_loop() -> None:
    import torch

    tb = _train_module()
    # prompt [7 8 9], then the model writes "1 2" three times: with min_seen=2 the first
    # repeat (a copy of a line, say) goes unmarked and the third "1 2" (a loop) is marked.
    seqs = torch.tensor([[7, 8, 9, 1, 2, 1, 2, 1, 2]])
    once = tb.repeated_ngram_mask(seqs, prompt_tokens=3, n=2, prompt_counts=False)
    assert once[0].tolist() == [False] * 6 + [True, True, True]
    twice = tb.repeated_ngram_mask(seqs, prompt_tokens=3, n=2, prompt_counts=False, min_seen=2)
    # (1,2) at 4 and 6 are its first two; at 8 the third. (2,1) at 5 and 7: the second is
    # not yet a loop.
    assert twice[0].tolist() == [False] * 8 + [True]


@pytest.mark.slow
def test_a_run_resumed_at_the_phase_boundary_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    import dataclasses

    tb = _train_module()
    cfg = dataclasses.replace(tb.TINY, checkpoint_every_steps=1)
    tb.train(cfg, tmp_path / "whole", quiet=True)
    ckpt = tmp_path / "run.ckpt"
    tb.train(cfg, tmp_path / "part", checkpoint=ckpt, quiet=True, stop_step=cfg.steps)
    tb.train(cfg, tmp_path / "resumed", checkpoint=ckpt, quiet=True)
    whole = (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == whole
    info = json.loads((tmp_path / "resumed" / "training_info.json").read_text())
    assert info["resumed_from_step"] == cfg.steps
    assert set(info["final_phase2_losses"]) >= {"unlikelihood", "generated_repeat_fraction"}


@pytest.mark.slow
def test_most_greedy_200_token_continuations_of_held_out_code_do_not_loop() -> None:
    import dataclasses

    import torch

    ev = _eval_module()
    torch.set_num_threads(1)
    model, tok, _ = ev.load_builtin(BUILTIN)
    stream, note = ev.heldout_stream(BUILTIN, tok)
    assert note == ""
    cfg = dataclasses.replace(ev.EvalConfig(), loop_prompts=10)
    loops = ev.loop_check(model.lm, stream, cfg)
    # docs/model.md: 24 % of 50 continuations loop (98 % before the unlikelihood phase).
    assert loops["fraction_below_threshold"] <= 0.5, loops["ratios"]
    assert loops["mean"] > 0.5, loops["ratios"]


def _edit_module() -> ModuleType:
    _train_module()  # puts scripts/ on sys.path, where edit_data lives
    import edit_data

    return edit_data


def test_edit_samples_rename_every_use_but_attributes_and_refuse_keyword_arguments() -> None:
    ed = _edit_module()
    source = (
        "def area(width, height):\n"
        '    """width times height."""\n'
        "    width = abs(width)  # width first\n"
        "    return box.width * width * area_of(height)\n"
    )
    (fn,) = ed.functions(source, 2000)
    assert fn.params == ("width", "height") and fn.docstring_lines == (2, 2)
    # Names are renamed; the attribute, the docstring and the comment are not.
    assert ed.rename(fn, "width", "w") == (
        "def area(w, height):\n"
        '    """width times height."""\n'
        "    w = abs(w)  # width first\n"
        "    return box.width * w * area_of(height)"
    )
    assert ed.rename(fn, "width", "height") is None  # the new name is taken
    assert ed.drop_docstring(fn) == (
        "def area(width, height):\n"
        "    width = abs(width)  # width first\n"
        "    return box.width * width * area_of(height)"
    )
    (kw,) = ed.functions("def f(x, y=1):\n    y += x\n    return g(x=x, y=y)\n", 2000)
    assert ed.rename(kw, "x", "z") is None  # g's parameter x is not ours to rename
    assert ed.rename(kw, "f", "f_v2") == "def f_v2(x, y=1):\n    y += x\n    return g(x=x, y=y)"


def test_edit_documents_repeat_their_function_edited_in_plain_and_chat_form() -> None:
    import ast

    tb = _train_module()
    ed = _edit_module()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [(stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    docs = ed.edit_documents(sources, 0, 1800, tb.render_chat)
    assert len(docs) > 10
    chats = [d for d in docs if d.startswith("<|user|>")]
    plain = [d for d in docs if not d.startswith("<|user|>")]
    assert chats and plain
    for doc in plain:
        original, _, rest = doc.partition("\n\n\n# ")
        _, _, edited = rest.partition("\n")
        ast.parse(original)
        ast.parse(edited)
        assert edited.rstrip() != original.rstrip()
        # An edit keeps most of the text: the answer is mostly a copy of the prompt.
        assert len(set(edited.split("\n")) & set(original.split("\n"))) >= 1
    for doc in chats:
        reply = doc.split("<|assistant|>\n```python\n", 1)[1].split("\n```<|end|>", 1)[0]
        ast.parse(reply)
    assert docs == ed.edit_documents(sources, 0, 1800, tb.render_chat)  # seeded


@pytest.mark.slow
def test_phases_3_and_4_from_an_exported_directory_equal_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    tb = _train_module()
    cfg = tb.TINY
    tb.train(cfg, tmp_path / "whole", quiet=True)
    tb.train(cfg, tmp_path / "phase2", quiet=True, stop_step=tb.phase3_start(cfg))
    tb.train(cfg, tmp_path / "from2", quiet=True, init_from=tmp_path / "phase2")
    tb.train(cfg, tmp_path / "phase3", quiet=True, stop_step=tb.phase4_start(cfg))
    tb.train(cfg, tmp_path / "from3", quiet=True, init_from=tmp_path / "phase3")
    whole = (tmp_path / "whole" / "model.safetensors").read_bytes()
    whole_info = json.loads((tmp_path / "whole" / "training_info.json").read_text())
    for start in ("phase2", "phase3"):
        done = tmp_path / f"from{start[-1]}"
        assert (done / "model.safetensors").read_bytes() == whole
        info = json.loads((done / "training_info.json").read_text())
        assert info["initialised_from"] == str(tmp_path / start)
        for key in ("final_train_losses", "final_phase2_losses", "final_phase3_losses"):
            assert info[key] == whole_info[key], (start, key)
        assert info["final_phase4_losses"] == whole_info["final_phase4_losses"]
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["max_position_embeddings"] == cfg.edit_context_tokens
