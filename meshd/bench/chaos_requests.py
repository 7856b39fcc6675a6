"""The requests of `meshd bench chaos`: a seeded set of streamed jobs, fired and judged.

Every job is a streamed chat or text completion of a fixed length (`ignore_eos`), greedy or
sampled with its own seed, so that an undisturbed run gives the reference text to compare
against. `stream_once` sends one job and records what the client saw, token by token; it
never raises for HTTP trouble and is bounded in time. `classify` then names how each request
ended, from what the client saw and what the storm did to its coordinator (the node whose
API it called):

- `completed`: `[DONE]` after a final chunk with a `finish_reason`, no error event;
- a clear error: an HTTP error status with an OpenAI error body (`http_503`, `http_429`, ...),
  an `error` event in the stream (`error_event`), a refused connection (`refused`; also a
  request sent to a node already stopping and reset unanswered as its listener closed), or the
  connection lost because its coordinator was SIGKILLed (`connection_lost`: a crashed
  process cannot say anything);
- `truncated_silently`: the stream stopped without `[DONE]` and without an error event while
  its coordinator was alive or stopping on SIGTERM (a graceful stop must end its streams with
  an error event), or `[DONE]` came without a `finish_reason`. Must never happen;
- `hung`: no byte for `stall_timeout_s`, or the request outlived `request_timeout_s`;
- `bad_response`: anything else the client could not read (a body that is not the API's).
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from meshd.bench.harness import nearest_rank
from meshd.bench.openai_requests import completion_body, completion_path, delta_text, retry_after_s

# Short prompts; the built-in model's context is 256 tokens, so prompt and answer fit.
PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map.",
    "def quicksort(items):",
    "The history of the printing press begins",
    "Translate to French: the cat sleeps on the warm windowsill.",
)
SAMPLED_TEMPERATURE = 0.8

# Ways a request ends (see the module docstring).
COMPLETED = "completed"
ERROR_EVENT = "error_event"
REFUSED = "refused"
CONNECTION_LOST = "connection_lost"
TRUNCATED = "truncated_silently"
HUNG = "hung"
BAD_RESPONSE = "bad_response"
# What the client saw when a stream stopped without [DONE] or an error event.
CUT_CLEAN_EOF = "clean_eof"  # the response ended properly, just early
CUT_RESET = "reset"  # the connection broke mid-response
CUT_NO_RESPONSE = "no_response"  # the connection closed before any response
NO_FINISH_REASON = "no_finish_reason"


@dataclass(frozen=True)
class ChaosJob:
    """One request of the load: `temperature` 0 is greedy, else sampled with `seed`."""

    index: int
    kind: str  # "chat" or "completion"
    prompt: str
    max_tokens: int
    temperature: float
    seed: int

    @property
    def greedy(self) -> bool:
        """True when the job decodes greedily."""
        return self.temperature == 0

    @property
    def path(self) -> str:
        """The endpoint's path under `/v1`."""
        return completion_path(self.kind)

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body: streamed, a fixed length whatever EOS the model picks."""
        return completion_body(
            model,
            self.kind,
            self.prompt,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stream=True,
        )


def make_jobs(seed: int, max_tokens: int) -> list[ChaosJob]:
    """Each prompt twice, greedy and sampled; chat and text completions alternate."""
    rng = random.Random(seed)
    jobs: list[ChaosJob] = []
    for i, prompt in enumerate(PROMPTS):
        kind = "chat" if i % 2 == 0 else "completion"
        for temperature in (0.0, SAMPLED_TEMPERATURE):
            jobs.append(
                ChaosJob(len(jobs), kind, prompt, max_tokens, temperature, rng.randrange(1 << 31))
            )
    return jobs


@dataclass
class Seen:
    """What the client saw of one request (times are `time.monotonic()`)."""

    job: int
    node: str  # the coordinator's name
    incarnation: int  # which run of that node (restarts count up)
    started: float
    ended: float = 0.0
    status: int = 0  # HTTP status; 0 when no response came
    error_body: bool = False  # an error status came with an OpenAI error object
    done: bool = False  # `data: [DONE]` arrived
    finish_reason: str | None = None
    error_event: str = ""  # the `code` (or message) of an error event in the stream
    cut: str = ""  # CUT_* when the connection ended the request
    hung: str = ""  # "stall" or "deadline" when the client gave up waiting
    bad: str = ""  # a body the client could not read
    detail: str = ""
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Timeouts:
    """How long the client waits: to connect, for the next byte, for the whole request."""

    connect_s: float = 5.0
    stall_s: float = 60.0
    request_s: float = 240.0


async def stream_once(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    job: ChaosJob,
    seen: Seen,
    timeouts: Timeouts,
) -> Seen:
    """Send `job` to `url` and fill `seen` (never raises for HTTP trouble; bounded in time)."""
    with trio.move_on_after(timeouts.request_s) as deadline:
        try:
            await _stream(client, url, model, job, seen, timeouts)
        except httpx.ConnectError as exc:
            # Never connected: a refusal (a dead or stopping node), told apart in `classify`.
            seen.status, seen.detail = -1, f"connect: {exc}"[:200]
        except httpx.TimeoutException as exc:
            seen.hung, seen.detail = "stall", type(exc).__name__
        except httpx.HTTPError as exc:
            # Closed or reset mid-way (RemoteProtocolError, ReadError): before any response
            # or after part of it.
            seen.cut = CUT_RESET if seen.status else CUT_NO_RESPONSE
            seen.detail = f"{type(exc).__name__}: {exc}"[:200]
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            seen.bad = f"{type(exc).__name__}: {exc}"[:200]
    if deadline.cancelled_caught:
        seen.hung = "deadline"
    seen.ended = time.monotonic()
    return seen


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    job: ChaosJob,
    seen: Seen,
    timeouts: Timeouts,
) -> None:
    timeout = httpx.Timeout(timeouts.stall_s, connect=timeouts.connect_s)
    request = client.build_request("POST", url + job.path, json=job.body(model), timeout=timeout)
    response = await client.send(request, stream=True)
    try:
        seen.status = response.status_code
        if response.status_code != 200:
            body = await response.aread()
            seen.error_body = _is_error_body(body)
            seen.detail = body.decode(errors="replace")[:200]
            seen.retry_after_s = retry_after_s(response)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                seen.done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                error = event["error"] or {}
                seen.error_event = str(error.get("code") or error.get("message") or "error")
                continue
            for choice in event.get("choices", ()):
                piece = delta_text(choice)
                if piece:
                    seen.text += piece
                    seen.token_times.append(time.monotonic())
                if choice.get("finish_reason"):
                    seen.finish_reason = str(choice["finish_reason"])
        if not seen.done and not seen.error_event:
            seen.cut = CUT_CLEAN_EOF
    finally:
        await response.aclose()


def _is_error_body(body: bytes) -> bool:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and bool(error.get("message"))


@dataclass(frozen=True)
class Disruption:
    """One thing the storm did to a node, at `at` (`time.monotonic()`, taken before acting).

    `kind` is "sigkill", "sigterm" or "restart"; `role` is the node's part in the plan then
    ("stage" or "spare"), `coordinating` how many of the load's streams it was serving.
    `escalated`: a SIGTERM that did not end the process in time, so a SIGKILL followed.
    """

    kind: str
    node: str
    incarnation: int
    at: float
    role: str
    coordinating: int
    escalated_at: float | None = None

    @property
    def role_label(self) -> str:
        """ "stage", "spare", "stage+coordinator" or "spare+coordinator"."""
        return self.role + ("+coordinator" if self.coordinating else "")


def classify(seen: Seen, disruptions: Sequence[Disruption]) -> tuple[str, str]:
    """How a request ended, and a sub-kind (see the module docstring).

    Sub-kinds: the HTTP status for an error status; for `truncated_silently`, what the client
    saw (`clean_eof`, `reset`, `no_response`, `no_finish_reason`) and the coordinator's state
    (`alive` or `sigterm`), e.g. "reset/sigterm".
    """
    if seen.hung:
        return HUNG, seen.hung
    if seen.bad:
        return BAD_RESPONSE, seen.bad
    if seen.status == -1:
        return REFUSED, "connect"
    if seen.status and seen.status != 200:
        clear = f"http_{seen.status}" if seen.error_body else BAD_RESPONSE
        return clear, f"http_{seen.status}"
    if seen.error_event:
        return ERROR_EVENT, seen.error_event
    if seen.done and not seen.cut:
        if seen.finish_reason:
            return COMPLETED, seen.finish_reason
        return TRUNCATED, f"{NO_FINISH_REASON}/alive"
    state = coordinator_state(seen, disruptions)
    if state == "sigkill":
        return CONNECTION_LOST, seen.cut or CUT_RESET
    if (
        state == "sigterm"
        and seen.cut == CUT_NO_RESPONSE
        and _sent_while_stopping(seen, disruptions)
    ):
        # Sent to a node already stopping, and never answered: the connection was waiting to
        # be accepted when the stopped node closed its listening socket, which resets it (the
        # kernel had completed the handshake). Any server exiting has that instant; what must
        # not happen is a request the node took in and then left unanswered.
        return REFUSED, "closed_at_exit"
    return TRUNCATED, f"{seen.cut or CUT_CLEAN_EOF}/{state}"


def _sent_while_stopping(seen: Seen, disruptions: Sequence[Disruption]) -> bool:
    return any(
        d.node == seen.node and d.incarnation == seen.incarnation and d.kind == "sigterm"
        and d.at <= seen.started
        for d in disruptions
    )  # fmt: skip


def coordinator_state(seen: Seen, disruptions: Sequence[Disruption]) -> str:
    """What the storm had done to the request's coordinator when the request ended."""
    state = "alive"
    for d in disruptions:
        if d.node != seen.node or d.incarnation != seen.incarnation:
            continue
        if d.escalated_at is not None and d.escalated_at <= seen.ended:
            return "sigkill"
        if d.at <= seen.ended and d.kind in ("sigkill", "sigterm"):
            state = d.kind
    return state


# A stall: a gap between two events with text over this long and over STALL_FACTOR times
# the stream's median gap. Only a stall that starts within STALL_HORIZON_S of a disruption
# is its doing (recovery is bounded by the daemons' `recovery_timeout_s`, 20 s by default).
STALL_MIN_S = 1.0
STALL_FACTOR = 5.0
STALL_HORIZON_S = 30.0


def resumed_at(s: Seen, t: float) -> float:
    """When a stream open at `t` got text again after the stall `t` caused.

    Text computed before the disruption may still arrive just after it (a SIGTERMed stage
    serves for a moment), so the stream's first stall that starts around `t` marks it; a
    stream with no such stall was not held up, and its next text after `t` counts.
    """
    after = [x for x in s.token_times if x > t]
    if not after:
        return s.ended
    before = [x for x in s.token_times if x <= t]
    seq = [before[-1] if before else s.started, *after]
    gaps = [b - a for a, b in itertools.pairwise(s.token_times)]
    limit = max(STALL_MIN_S, STALL_FACTOR * statistics.median(gaps)) if gaps else STALL_MIN_S
    for a, b in itertools.pairwise(seq):
        if a > t + STALL_HORIZON_S:
            break
        if b - a > limit:
            return b
    return after[0]


def recovery_s(
    disruption: Disruption, seen: Sequence[Seen], outcomes: Sequence[str]
) -> float | None:
    """Seconds from a SIGKILL/SIGTERM until the mesh serves again (None: nothing to tell).

    Every stream that was open at the disruption, not coordinated by the victim and that
    completed must have got text again after the stall it caused (`resumed_at`): the slowest
    of them says when the mesh recovered. With no such stream, the first text of the first
    request sent after it that completed.
    """
    t = disruption.at
    waits = [
        resumed_at(s, t) - t
        for s, outcome in zip(seen, outcomes, strict=True)
        if s.started < t < s.ended and outcome == COMPLETED and s.node != disruption.node
    ]
    if waits:
        return max(waits)
    later = [
        s.token_times[0] - t
        for s, outcome in zip(seen, outcomes, strict=True)
        if s.started >= t and outcome == COMPLETED and s.token_times
    ]
    return min(later) if later else None


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p99/max by nearest rank (None when there is nothing to rank), and how many."""
    ranked = sorted(values)
    return {
        "p50": nearest_rank(ranked, 50),
        "p99": nearest_rank(ranked, 99),
        "max": nearest_rank(ranked, 100),
        "count": len(ranked),
    }
