"""`meshd bench chaos`: how each request's end is told, recovery times, and a short storm of
real daemons (SIGKILL, SIGTERM and restarts of coordinators and stages) that must truncate no
stream silently and leave no session or KV behind once the session lease has passed.

The client's judgement is checked against a raw HTTP server on loopback that ends a stream in
each way a daemon can: properly without `[DONE]`, by breaking the connection, or not at all.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time

import httpx
import pytest
import trio

import meshd
from meshd.bench.chaos_requests import (
    COMPLETED,
    CONNECTION_LOST,
    ERROR_EVENT,
    HUNG,
    REFUSED,
    TRUNCATED,
    Disruption,
    Seen,
    Timeouts,
    classify,
    make_jobs,
    recovery_s,
    stream_once,
)
from meshd.cli.main import main
from tests.node.daemons import host_number


def seen(**kw: object) -> Seen:
    s = Seen(job=0, node="n1", incarnation=1, started=10.0, ended=20.0)
    for key, value in kw.items():
        setattr(s, key, value)
    return s


def hit(
    kind: str,
    at: float,
    *,
    node: str = "n1",
    incarnation: int = 1,
    escalated_at: float | None = None,
) -> Disruption:
    return Disruption(kind, node, incarnation, at, "stage", 1, escalated_at)


def test_jobs_are_seeded_greedy_and_sampled_chat_and_text() -> None:
    jobs = make_jobs(seed=3, max_tokens=24)
    assert jobs == make_jobs(seed=3, max_tokens=24)
    assert [j.seed for j in jobs] != [j.seed for j in make_jobs(seed=4, max_tokens=24)]
    assert {(j.kind, j.greedy) for j in jobs} == {
        (kind, greedy) for kind in ("chat", "completion") for greedy in (True, False)
    }
    body = jobs[0].body("m")
    assert body["stream"] is True and body["meshd"] == {"ignore_eos": True}
    assert all(j.max_tokens == 24 for j in jobs)


def test_a_request_that_ended_properly_is_completed() -> None:
    assert classify(seen(status=200, done=True, finish_reason="length"), ()) == (
        COMPLETED,
        "length",
    )


def test_done_without_a_finish_reason_is_a_silent_truncation() -> None:
    assert classify(seen(status=200, done=True), ())[0] == TRUNCATED


def test_error_statuses_with_an_openai_body_are_clear_errors() -> None:
    assert classify(seen(status=503, error_body=True), ()) == ("http_503", "http_503")
    assert classify(seen(status=429, error_body=True), ())[0] == "http_429"
    assert classify(seen(status=503, error_body=False), ())[0] == "bad_response"
    assert classify(seen(status=-1), ())[0] == REFUSED
    assert classify(seen(status=200, error_event="stage_lost", cut="reset"), ())[0] == ERROR_EVENT


def test_a_cut_stream_is_clear_only_when_its_coordinator_was_sigkilled_before() -> None:
    cut = seen(status=200, cut="reset", ended=20.0)
    assert classify(cut, [hit("sigkill", 19.0)]) == (CONNECTION_LOST, "reset")
    # A graceful stop must say why it ends a stream; a live node must not cut one at all.
    assert classify(cut, [hit("sigterm", 19.0)]) == (TRUNCATED, "reset/sigterm")
    assert classify(cut, ()) == (TRUNCATED, "reset/alive")
    eof = seen(status=200, cut="clean_eof")
    assert classify(eof, [hit("sigterm", 12.0)]) == (TRUNCATED, "clean_eof/sigterm")
    # A SIGTERM the daemon did not act on in time, then SIGKILLed: a crash after all.
    escalated = hit("sigterm", 12.0, escalated_at=19.5)
    assert classify(cut, [escalated])[0] == CONNECTION_LOST
    # Only disruptions of that node's run, before the cut, count.
    assert classify(cut, [hit("sigkill", 19.0, incarnation=2)])[0] == TRUNCATED
    assert classify(cut, [hit("sigkill", 19.0, node="n2")])[0] == TRUNCATED
    assert classify(cut, [hit("sigkill", 21.0)])[0] == TRUNCATED


def test_a_request_the_client_gave_up_on_is_hung() -> None:
    assert classify(seen(status=200, hung="stall"), ())[0] == HUNG


def test_recovery_is_the_slowest_surviving_stream_to_get_text_after_its_stall() -> None:
    d = hit("sigkill", 10.01, node="n1")
    steady = [9.6 + 0.1 * i for i in range(40)]  # never held up: its next text counts
    # Text computed before the kill still arrives at 10.05; then a 3 s stall.
    stalled = [9.6, 9.7, 9.8, 9.9, 10.0, 10.05, 13.05, 13.15, 13.25, 13.35]
    streams = [
        seen(node="n2", started=5.0, ended=20.0, token_times=steady),
        seen(node="n3", started=5.0, ended=20.0, token_times=stalled),
        # Coordinated by the victim: it ends; it does not tell when the mesh recovered.
        seen(node="n1", started=5.0, ended=10.2, token_times=[9.9]),
        # Not open at the disruption.
        seen(node="n2", started=11.0, ended=20.0, token_times=[11.5, 11.6]),
    ]
    outcomes = [COMPLETED, COMPLETED, CONNECTION_LOST, COMPLETED]
    assert recovery_s(d, streams, outcomes) == pytest.approx(3.04)
    assert recovery_s(d, streams[:1], outcomes[:1]) == pytest.approx(0.09)
    # A spare's loss: nothing stalls, the mesh serves on.
    assert recovery_s(d, streams[:1] + streams[3:], outcomes[:1] + outcomes[3:]) < 0.1
    # No surviving stream: the first text of a request sent after it that completed.
    assert recovery_s(d, streams[2:], outcomes[2:]) == pytest.approx(1.49)
    assert recovery_s(d, streams[2:3], outcomes[2:3]) is None


# -- the client against a raw HTTP server ----------------------------------------------------

CHUNK = 'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
FINAL = 'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'


def _chunk(text: str) -> bytes:
    data = text.encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _serve_once(
    how: str, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer one request on a free port, ending the stream as `how` says."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    stream = await listeners[0].accept()
    async with stream:
        received = b""
        while b"\r\n\r\n" not in received:
            received += await stream.receive_some()
        if how == "no_response":
            return
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        await stream.send_all(head + b"transfer-encoding: chunked\r\n\r\n" + _chunk(CHUNK))
        if how == "complete":
            await stream.send_all(_chunk(FINAL) + b"0\r\n\r\n")
        elif how == "clean_eof":
            await stream.send_all(b"0\r\n\r\n")
        elif how == "stall":
            await trio.sleep_forever()
        # "reset": close mid-body


@pytest.mark.parametrize("how", ["complete", "clean_eof", "reset", "no_response", "stall"])
async def test_the_client_tells_how_a_stream_ended(how: str) -> None:
    job = make_jobs(seed=0, max_tokens=4)[0]
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        port = await nursery.start(_serve_once, how)
        s = Seen(0, "n1", 1, 0.0)
        timeouts = Timeouts(connect_s=5, stall_s=0.5, request_s=30)
        await stream_once(client, f"http://127.0.0.1:{port}/v1", "m", job, s, timeouts)
        nursery.cancel_scope.cancel()
    kind, sub = classify(s, ())
    expected = {
        "complete": (COMPLETED, "length"),
        "clean_eof": (TRUNCATED, "clean_eof/alive"),
        "reset": (TRUNCATED, "reset/alive"),
        "no_response": (TRUNCATED, "no_response/alive"),
        "stall": (HUNG, "stall"),
    }[how]
    assert (kind, sub) == expected, s.detail
    if how != "no_response":
        assert s.text.startswith("hi") and len(s.token_times) >= 1


async def test_a_port_nobody_listens_on_is_a_refusal() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    s = Seen(0, "n1", 1, 0.0)
    async with httpx.AsyncClient() as client:
        job = make_jobs(seed=0, max_tokens=4)[0]
        await stream_once(client, f"http://127.0.0.1:{port}/v1", "m", job, s, Timeouts())
    assert classify(s, ())[0] == REFUSED


def test_no_product_module_imports_the_benches() -> None:
    root = pathlib.Path(meshd.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(root / "bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("meshd.bench")]
    assert offenders == []


# -- a real storm ------------------------------------------------------------------------------


def _process_gone(pid: int) -> bool:
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"serve" not in cmdline  # the pid was reused by something else


@pytest.mark.slow
def test_a_short_storm_truncates_nothing_silently_and_leaks_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The real command in this process (the daemons are child processes). The first pair of
    # disruptions is a SIGKILL then a SIGTERM: two of them, each restarted, one of them of a
    # coordinator, exercise every kind of fault; longer storms are `meshd bench chaos`'s.
    # One undisturbed round gives the reference texts (the bench's default of two also checks
    # that they are stable: `meshd bench chaos`'s job, not this test's).
    quick = ["--quick", "--disruptions", "2", "--reference-rounds", "1"]
    status = main(["bench", "chaos", *quick, "--json", "--first-host", str(host_number(51))])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    # The bench leaves nothing behind, whatever it found.
    assert "disruptions" in report, (report["failures"], capsys.readouterr().err[-3000:])
    assert report["pids"] and all(_process_gone(pid) for pid in report["pids"])
    assert not pathlib.Path(report["work_dir"]).exists()
    counts = {kind: sum(by_role.values()) for kind, by_role in report["disruptions"].items()}
    assert counts["sigkill"] >= 1 and counts["sigterm"] >= 1 and counts["restart"] >= 1, counts
    assert report["coordinator_disruptions"] >= 1
    assert report["completed_identical_greedy"] >= 1
    assert report["reference"]["failed_runs"] == 0
    # Every must-be-0 at once, so that one failing does not hide the others.
    zero = ("truncated_silently", "hung", "leaked_sessions", "leaked_kv_bytes")
    must_be_zero = {key: report[key] for key in (*zero, "open_coordinated_sessions")}
    assert must_be_zero == dict.fromkeys(must_be_zero, 0), (
        report["failures"],
        report["truncated_silently_by_kind"],
        report["nodes_after"],
        report["must_not_happen"][:5],
    )
    assert report["after_storm_completed"] == report["after_storm_requests"] == 4
    assert status == 0, report["failures"]


def _sigint_as_in_a_terminal() -> None:
    """In the child before exec: Ctrl-C's default action. A pytest-xdist worker ignores
    SIGINT, and a Python started with SIGINT ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_in_the_storm_stops_every_daemon_and_removes_the_work_dir() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
    command = [sys.executable, "-m", "meshd.cli.main", "bench", "chaos", "--quick", "--json"]
    # One reference round: the storm, where Ctrl-C comes, starts sooner.
    proc = subprocess.Popen(
        [*command, "--reference-rounds", "1", "--first-host", str(host_number(56))], cwd=pathlib.Path(meshd.__file__).parents[1], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_in_a_terminal,
    )  # fmt: skip
    assert proc.stderr is not None
    progress: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("] storm:" in line for line in progress):
            assert time.monotonic() < deadline and proc.poll() is None, progress
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                progress.append(proc.stderr.readline())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(progress) + err
    assert proc.returncode == 130, text[-3000:]
    pids = [int(p) for p in re.findall(r"n\d: run \d+, pid (\d+), work dir", text)]
    work = re.search(r"work dir (\S+) removed", text)
    assert len(pids) == 4 and all(_process_gone(pid) for pid in pids), text[-3000:]
    assert work is not None and not pathlib.Path(work.group(1)).exists()


def test_an_unanswered_request_is_clear_only_when_sent_to_a_node_already_stopping() -> None:
    # Sent after the SIGTERM and reset unanswered: the stopped node's listening socket closed
    # with the connection still waiting to be accepted. Sent before it: the node had it.
    late = seen(cut="no_response", started=15.0, ended=20.0)
    assert classify(late, [hit("sigterm", 12.0)]) == (REFUSED, "closed_at_exit")
    early = seen(cut="no_response", started=10.0, ended=20.0)
    assert classify(early, [hit("sigterm", 12.0)]) == (TRUNCATED, "no_response/sigterm")
    # A node that was not stopping must answer whatever it accepted.
    assert classify(late, ())[0] == TRUNCATED
