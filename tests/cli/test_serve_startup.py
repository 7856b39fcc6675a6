"""`meshd serve` start-up errors: one line on stderr and exit status 2, never a traceback.

systemd's `RestartPreventExitStatus=2` (systemd/meshd.service) relies on the status: a bad
model path or a port in use must not restart-loop. Each case runs the real command.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest

from meshd.model.builtin import builtin_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SECRET = "meshd-test-secret-0123456789abcdef"


def serve(
    tmp: pathlib.Path, *args: str, secret_file: pathlib.Path | None = None
) -> tuple[int, str]:
    if secret_file is None:
        secret_file = tmp / "secret"
        secret_file.write_text(SECRET)
        secret_file.chmod(0o600)
    result = subprocess.run(
        [sys.executable, "-m", "meshd.cli.main", "serve", "--state-dir", str(tmp / "state"),
         "--mesh-secret-file", str(secret_file), "--listen-host", "127.0.0.1",
         "--listen-port", "0", "--api-port", "0", *args],
        cwd=REPO, env={"PATH": os.environ["PATH"], "HOME": str(tmp)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return result.returncode, result.stderr


def assert_one_line(code: int, stderr: str, *expected: str, prefix: str = "meshd serve: ") -> None:
    assert code == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(prefix) and "Traceback" not in stderr
    for text in expected:
        assert text in lines[0], lines[0]


def checkpoint_copy(tmp: pathlib.Path, edit: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """The built-in checkpoint copied to `tmp/model`, then changed by `edit`."""
    model = tmp / "model"
    shutil.copytree(builtin_model_dir(), model)
    edit(model)
    return model


def test_a_missing_model_and_one_that_is_not_a_directory_are_told_apart(
    tmp_path: pathlib.Path,
) -> None:
    assert_one_line(*serve(tmp_path, "--model", str(tmp_path / "nope")), "not found")
    assert_one_line(*serve(tmp_path, "--model", "/etc/passwd"), "/etc/passwd is not a directory")
    (tmp_path / "empty").mkdir()
    assert_one_line(*serve(tmp_path, "--model", str(tmp_path / "empty")), "has no config.json")


def test_a_damaged_gguf_file_is_one_line(tmp_path: pathlib.Path) -> None:
    damaged = tmp_path / "model.gguf"
    damaged.write_bytes(b"GGUF" + bytes(60))
    code, stderr = serve(tmp_path, "--model", str(damaged))
    assert_one_line(code, stderr, "model: ", str(damaged))
    assert "is not a directory" not in stderr  # a .gguf file is a model format, not a mistake


def test_an_unsupported_checkpoint_is_one_line(tmp_path: pathlib.Path) -> None:
    def gpt2(model: pathlib.Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config["model_type"], config["architectures"] = "gpt2", ["GPT2LMHeadModel"]
        (model / "config.json").write_text(json.dumps(config))

    assert_one_line(*serve(tmp_path, "--model", str(checkpoint_copy(tmp_path, gpt2))), "gpt2")


def test_a_corrupt_safetensors_file_is_one_line(tmp_path: pathlib.Path) -> None:
    def corrupt(model: pathlib.Path) -> None:
        weights = model / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[8:40] = b"\x00not json at all\x00" * 2
        weights.write_bytes(bytes(data))

    code, stderr = serve(tmp_path, "--model", str(checkpoint_copy(tmp_path, corrupt)))
    assert_one_line(code, stderr, "model.safetensors")


def test_a_model_that_fails_while_the_daemon_starts_is_one_line_too(
    tmp_path: pathlib.Path,
) -> None:
    # Passes the up-front checks (config and safetensors headers) and fails in the daemon.
    model = checkpoint_copy(tmp_path, lambda m: (m / "tokenizer.json").unlink())
    assert_one_line(*serve(tmp_path, "--model", str(model)), "tokenizer.json")


def test_an_unreadable_secret_file_is_one_line(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a-directory").mkdir()
    code, stderr = serve(tmp_path, secret_file=tmp_path / "a-directory")
    assert_one_line(code, stderr, "mesh_secret_file", "cannot read")
    code, stderr = serve(tmp_path, "--api-key-file", str(tmp_path / "missing.key"))
    assert_one_line(code, stderr, "api_key_file", "cannot read")


@pytest.mark.parametrize("kind", ["api", "lanes"])
def test_a_port_in_use_is_one_line(tmp_path: pathlib.Path, kind: str) -> None:
    proto = socket.SOCK_STREAM if kind == "api" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, proto) as taken:
        taken.bind(("127.0.0.1", 0))
        if kind == "api":
            taken.listen()
        port = str(taken.getsockname()[1])
        flag = "--api-port" if kind == "api" else "--listen-port"
        code, stderr = serve(tmp_path, flag, port)
    key = "api_port" if kind == "api" else "listen_port"
    assert_one_line(code, stderr, key, f"127.0.0.1:{port}", "in use")


def test_config_errors_are_one_line(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "meshd.toml"
    config.write_text("api_prot = 7392\n")
    assert_one_line(*serve(tmp_path, "--config", str(config)), "unknown key 'api_prot'")
    code, stderr = serve(tmp_path, "--api-body-timeout-s", "0")
    assert_one_line(code, stderr, "api_body_timeout_s must be a positive number")
    code, stderr = serve(tmp_path, "--api-prot", "7392")
    assert_one_line(code, stderr, "unrecognized arguments: --api-prot", prefix="meshd: error: ")


def test_a_draft_model_with_another_tokenizer_is_one_line_naming_both(
    tmp_path: pathlib.Path,
) -> None:
    def other_tokenizer(model: pathlib.Path) -> None:
        data = json.loads((model / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        first, second = sorted(vocab, key=vocab.__getitem__)[300:302]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (model / "tokenizer.json").write_text(json.dumps(data))

    draft = checkpoint_copy(tmp_path, other_tokenizer)
    code, stderr = serve(tmp_path, "--speculative-draft-model", str(draft))
    assert_one_line(code, stderr, "spec.draft_model", "differs", str(draft), "builtin")


def test_a_mesh_model_no_member_holds_ends_in_one_line_after_holder_wait_s(
    tmp_path: pathlib.Path,
) -> None:
    # Nobody answers at the join address: the start-up fetch of the manifest tries again
    # (each failed try is a log line) until fetch.holder_wait_s passed, then ends the daemon.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, stderr = serve(
        tmp_path,
        "--model", "mesh:0123456789abcdef", "--join", f"127.0.0.1:{port}",
        "--fetch-holder-wait-s", "2",
    )  # fmt: skip
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.splitlines()[-1]
    assert last.startswith("meshd serve: model: mesh:0123456789abcdef: no `join` peer"), last
    assert "fetch.holder_wait_s" in last, last
