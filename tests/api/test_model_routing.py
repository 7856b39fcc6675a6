"""One API over two models: requests route by their `model` field (name or alias), each model
answers with its own tokens, `/v1/models` lists both, and an unknown model is a 404 that lists
them (OpenAI's error shape)."""

from __future__ import annotations

import pathlib

import httpx
import trio

from meshd.api.backend import open_local_backend
from meshd.api.openai import create_app
from meshd.api.routing import LocalModels
from meshd.api.server import serve_api
from meshd.bench.single_node import generate
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.model.tokenizer import Tokenizer
from tests.node.test_several_models import second_checkpoint

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 12


def _alone(model_dir: pathlib.Path, prompt: list[int]) -> list[int]:
    checkpoint = Checkpoint.open(model_dir)
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    return generate([stage], prompt, MAX_TOKENS).tokens


async def test_requests_route_by_model_and_unknown_models_are_404(tmp_path: pathlib.Path) -> None:
    second = second_checkpoint(tmp_path / "second")
    tokenizer = Tokenizer.open(builtin_model_dir())
    prompt = tokenizer.encode(PROMPT)
    expected = {
        "meshd-builtin": tokenizer.decode(_alone(builtin_model_dir(), prompt)),
        "second": tokenizer.decode(_alone(second, prompt)),
    }
    assert expected["meshd-builtin"] != expected["second"]
    async with (
        open_local_backend(stages=1) as builtin,
        open_local_backend(second, stages=1) as other,
        trio.open_nursery() as nursery,
    ):
        app = create_app(builtin, catalog=LocalModels([builtin, other]))
        address = await nursery.start(serve_api, app)
        async with httpx.AsyncClient(base_url=address.base_url, timeout=60) as client:
            listed = (await client.get("/models")).json()["data"]
            assert [m["id"] for m in listed] == ["meshd-builtin", "second"]
            assert (await client.get("/models/second")).json()["id"] == "second"
            for name, text in expected.items():
                body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                        "temperature": 0, "meshd": {"ignore_eos": True}}  # fmt: skip
                reply = await client.post("/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["model"] == name
                assert reply.json()["choices"][0]["text"] == text, name
            for path, body in (
                ("/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}),
                ("/chat/completions",
                 {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            ):  # fmt: skip
                reply = await client.post(path, json=body)
                assert reply.status_code == 404, reply.text
                error = reply.json()["error"]
                assert error["code"] == "model_not_found" and error["param"] == "model"
                assert error["type"] == "invalid_request_error"
                assert "`meshd-builtin`, `second`" in error["message"]
            missing = await client.get("/models/nope")
            assert missing.status_code == 404
            assert "`second`" in missing.json()["error"]["message"]
        nursery.cancel_scope.cancel()
