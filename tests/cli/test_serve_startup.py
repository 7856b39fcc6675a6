"""`meshd serve` start-up errors: one line on stderr and exit status 2, never a traceback.

systemd's `RestartPreventExitStatus=2` (systemd/meshd.service) relies on the status: a bad
model path, a damaged model file, a full or read-only state dir, a bad identity key or a port
in use must not restart-loop. Each case runs the real command.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator

import gguf
import pytest

from meshd.bench.gguf_writer import write_gguf
from meshd.mesh.identity import NodeIdentity
from meshd.model.builtin import builtin_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SECRET = "meshd-test-secret-0123456789abcdef"
MAIN = [sys.executable, "-m", "meshd.cli.main"]
# `meshd serve` with its port check skipped: the daemon's own bind meets a port taken after
# the check, as when another process takes it while the model loads.
NO_PORT_CHECK = [
    sys.executable, "-c",
    "import sys, meshd.cli.serve as s; from meshd.cli.main import main; "
    "s.check_ports = lambda config: None; sys.exit(main())",
]  # fmt: skip


def serve(
    tmp: pathlib.Path,
    *args: str,
    secret_file: pathlib.Path | None = None,
    state: pathlib.Path | None = None,
    command: list[str] = MAIN,
) -> tuple[int, str]:
    if secret_file is None:
        secret_file = tmp / "secret"
        secret_file.write_text(SECRET)
        secret_file.chmod(0o600)
    result = subprocess.run(
        [*command, "serve", "--state-dir", str(state or tmp / "state"),
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
    assert_one_line(code, stderr, "api.key_file", "cannot read")


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


@pytest.mark.parametrize("kind", ["api", "lanes"])
def test_a_port_taken_after_the_check_is_one_line_too(tmp_path: pathlib.Path, kind: str) -> None:
    proto = socket.SOCK_STREAM if kind == "api" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, proto) as taken:
        taken.bind(("127.0.0.1", 0))
        if kind == "api":
            taken.listen()
        port = str(taken.getsockname()[1])
        flag = "--api-port" if kind == "api" else "--listen-port"
        code, stderr = serve(tmp_path, flag, port, command=NO_PORT_CHECK)
    # The daemon has logged its start by then; its error is still one line, no traceback.
    assert code == 2 and "Traceback" not in stderr, stderr
    *logged, last = stderr.splitlines()
    assert all(" INFO " in line for line in logged), stderr
    key = "api_port" if kind == "api" else "listen_port"
    assert_one_line(code, last, key, f"127.0.0.1:{port}", "in use")


def test_config_errors_are_one_line(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "meshd.toml"
    config.write_text("api_prot = 7392\n")
    assert_one_line(*serve(tmp_path, "--config", str(config)), "unknown key 'api_prot'")
    code, stderr = serve(tmp_path, "--api-body-timeout-s", "0")
    assert_one_line(code, stderr, "api.body_timeout_s must be a positive number")
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


# --- the state dir and the identity key --------------------------------------------------


@contextlib.contextmanager
def tmpfs(where: pathlib.Path) -> Iterator[pathlib.Path]:
    """A 64 KiB tmpfs mounted at `where` (root only: the test is skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills up, a read-only one) needs root")
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(where)]
    result = subprocess.run(mount, capture_output=True, text=True, check=False)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill(directory: pathlib.Path) -> None:
    """Write into `directory` until its file system has no space left."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, bytes(4096))
    finally:
        os.close(fd)


def remount_read_only(where: pathlib.Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


def test_a_state_dir_on_a_full_disk_is_one_line(tmp_path: pathlib.Path) -> None:
    with tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        code, stderr = serve(tmp_path, state=disk / "state")
    assert_one_line(code, stderr, "identity.key", "No space left on device", "free space")


def test_a_state_dir_that_cannot_be_created_is_one_line(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a-file").write_text("")
    code, stderr = serve(tmp_path, state=tmp_path / "a-file" / "state")
    assert_one_line(code, stderr, "a-file/state", "Not a directory")


def test_a_state_dir_on_a_read_only_file_system_is_one_line(tmp_path: pathlib.Path) -> None:
    with tmpfs(tmp_path / "disk") as disk:
        remount_read_only(disk)
        code, stderr = serve(tmp_path, state=disk / "state")
    assert_one_line(code, stderr, "disk/state", "Read-only file system")


def test_a_read_only_state_dir_that_holds_the_key_is_one_line(tmp_path: pathlib.Path) -> None:
    # The key loads, but the control socket cannot be created next to it.
    with tmpfs(tmp_path / "disk") as disk:
        NodeIdentity.load_or_create(disk)
        remount_read_only(disk)
        code, stderr = serve(tmp_path, state=disk)
    assert_one_line(code, stderr, "control_socket", "control.sock", "read-only file system")


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b"\x8f\x00garbage\xff", "JSON is malformed"),
        (b"", "corrupt"),
        (b'{"kind": "meshd-identity", "version": 1, "ed25519_seed": "00ff", '
         b'"ed25519_public": "00ff"}', "seed is not 32 bytes"),
    ],
    ids=["garbage", "empty", "short-seed"],
)  # fmt: skip
def test_a_corrupt_identity_key_is_one_line_and_left_alone(
    tmp_path: pathlib.Path, content: bytes, what: str
) -> None:
    key = tmp_path / "state" / "identity.key"
    key.parent.mkdir(mode=0o700)
    key.write_bytes(content)
    key.chmod(0o600)
    code, stderr = serve(tmp_path)
    assert_one_line(code, stderr, str(key), "corrupt", what, "mv ")
    assert key.read_bytes() == content  # never replaced: the node's identity is the operator's


def test_an_identity_key_others_can_read_is_refused_with_the_fix(tmp_path: pathlib.Path) -> None:
    key = NodeIdentity.load_or_create(tmp_path / "state").path
    assert key is not None
    key.chmod(0o644)
    code, stderr = serve(tmp_path)
    assert_one_line(code, stderr, str(key), "mode 0644", f"chmod 600 '{key}'")


# --- GGUF model files --------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_gguf(builtin_model_dir(), tmp_path_factory.mktemp("gguf") / "good.gguf", "Q8_0")


def gguf_end(path: pathlib.Path) -> int:
    """Where the file's last tensor ends: data start + max(offset + size) over its tensors."""
    reader = gguf.GGUFReader(path)
    return max(t.data_offset + t.n_bytes for t in reader.tensors)


def test_a_truncated_gguf_file_says_how_many_bytes_are_missing(
    tmp_path: pathlib.Path, good_gguf: pathlib.Path
) -> None:
    data = good_gguf.read_bytes()
    expected, size = gguf_end(good_gguf), len(data) // 2  # an interrupted download
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:size])
    code, stderr = serve(tmp_path, "--model", str(cut))
    assert_one_line(
        code, stderr, str(cut), f"truncated: expected {expected} bytes, file has {size}"
    )
    assert "reshape" not in stderr


def test_a_gguf_file_cut_inside_its_header_is_one_line(
    tmp_path: pathlib.Path, good_gguf: pathlib.Path
) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good_gguf.read_bytes()[:5000])  # inside the vocabulary
    code, stderr = serve(tmp_path, "--model", str(cut))
    assert_one_line(code, stderr, str(cut), "truncated or corrupt", "file has 5000")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: b"GGML" + d[4:], ["not a GGUF file", "b'GGML'"]),
        (lambda d: d[:4] + (7).to_bytes(4, "little") + d[8:], ["GGUF version 7 is not supported"]),
        (lambda d: bytes(range(256)) * 64, ["not a GGUF file"]),
        (lambda d: b"", ["empty"]),
    ],
    ids=["magic", "version", "garbage", "empty"],
)
def test_a_gguf_file_with_a_bad_header_is_one_line(
    tmp_path: pathlib.Path,
    good_gguf: pathlib.Path,
    edit: Callable[[bytes], bytes],
    words: list[str],
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(edit(good_gguf.read_bytes()))
    assert_one_line(*serve(tmp_path, "--model", str(bad)), str(bad), *words)


def test_a_gguf_tensor_of_an_unknown_type_is_one_line(
    tmp_path: pathlib.Path, good_gguf: pathlib.Path
) -> None:
    tensor = gguf.GGUFReader(good_gguf).tensors[0]
    # Tensor info: name length, name, dimension count, dimensions, type, offset.
    type_at = tensor.field.offset + sum(int(part.nbytes) for part in tensor.field.parts[:4])
    data = bytearray(good_gguf.read_bytes())
    data[type_at : type_at + 4] = (200).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    code, stderr = serve(tmp_path, "--model", str(bad))
    assert_one_line(code, stderr, str(bad), repr(tensor.name), "unknown type 200")


def test_a_gguf_file_of_an_unsupported_architecture_is_one_line(tmp_path: pathlib.Path) -> None:
    other = write_gguf(builtin_model_dir(), tmp_path / "falcon.gguf", arch="falcon")
    code, stderr = serve(tmp_path, "--model", str(other))
    assert_one_line(code, stderr, str(other), "'falcon' is not supported")


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


# `meshd serve` that writes, as it exits, whether torch was imported (to ~/torch-imported).
TRACK_TORCH = [
    sys.executable, "-c",
    "import os, sys\nfrom meshd.cli.main import main\ntry:\n    code = main()\nfinally:\n"
    "    with open(os.path.expanduser('~/torch-imported'), 'w') as f:\n"
    "        f.write(str('torch' in sys.modules))\nsys.exit(code)",
]  # fmt: skip


def retyped(good: pathlib.Path, dest: pathlib.Path, ggml_type: int) -> tuple[pathlib.Path, str]:
    """`good` with its first matrix's type field set to `ggml_type` (its bytes kept)."""
    tensor = next(t for t in gguf.GGUFReader(good).tensors if len(t.shape) == 2)
    type_at = tensor.field.offset + sum(int(part.nbytes) for part in tensor.field.parts[:4])
    data = bytearray(good.read_bytes())
    data[type_at : type_at + 4] = ggml_type.to_bytes(4, "little")
    dest.write_bytes(bytes(data))
    return dest, tensor.name


def test_a_gguf_tensor_of_a_type_without_a_reader_names_tensor_and_type(
    tmp_path: pathlib.Path, good_gguf: pathlib.Path
) -> None:
    # IQ4_NL: a real ggml type (blocks of 32 values, smaller than Q8_0's, so the file still
    # holds every byte) that meshd has no reader for.
    bad, name = retyped(good_gguf, tmp_path / "iq4.gguf", int(gguf.GGMLQuantizationType.IQ4_NL))
    code, stderr = serve(tmp_path, "--model", str(bad))
    assert_one_line(code, stderr, str(bad), repr(name), "stored as IQ4_NL", "supported GGUF types")


@pytest.mark.parametrize("fault", ["truncated", "unknown type", "no reader", "architecture"])
def test_a_bad_gguf_file_is_refused_before_torch_is_imported(
    tmp_path: pathlib.Path, good_gguf: pathlib.Path, fault: str
) -> None:
    # Importing torch is most of the seconds a refusal used to take: the file is checked first.
    bad = tmp_path / "bad.gguf"
    if fault == "truncated":
        bad.write_bytes(good_gguf.read_bytes()[: good_gguf.stat().st_size // 2])
    elif fault == "unknown type":
        retyped(good_gguf, bad, 200)
    elif fault == "no reader":
        retyped(good_gguf, bad, int(gguf.GGMLQuantizationType.IQ4_NL))
    else:
        write_gguf(builtin_model_dir(), bad, arch="falcon")
    code, stderr = serve(tmp_path, "--model", str(bad), command=TRACK_TORCH)
    assert_one_line(code, stderr, str(bad))
    assert (tmp_path / "torch-imported").read_text() == "False"
