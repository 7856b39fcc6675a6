"""`meshd demo --in-process`: the stage nodes in this one process, no daemons.

Each stage node still has its own UDP endpoint and encrypted lanes (the code the daemons run),
with latency between them emulated in userspace. It streams one chat completion with
speculative decoding, then prints tokens/s and the speculative statistics. Useful where
spawning daemons is not (a notebook, a machine without 127.0.0.x aliases).
"""

from __future__ import annotations

import argparse
import sys
import time

import trio

from meshd.coord.local import open_local_pipeline
from meshd.coord.pipeline import GenerationRequest
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.spec.config import SpecConfig
from protocol.messages import Sampling


def run(args: argparse.Namespace) -> int:
    """Run the in-process demo once (the options are `meshd demo`'s)."""
    return trio.run(_demo, args)


async def _demo(args: argparse.Namespace) -> int:
    model_dir = args.model or str(builtin_model_dir())
    tokenizer = open_tokenizer(model_dir)
    checkpoint = open_checkpoint(model_dir)
    say = print
    say(f"meshd demo — model {checkpoint.model_id[:16]} ({checkpoint.config.num_layers} layers)")
    say(f"starting {args.stages} stage nodes on loopback, emulated RTT {args.rtt_ms:g} ms …")
    t_start = time.perf_counter()
    async with open_local_pipeline(
        model_dir,
        args.stages,
        rtt_s=args.rtt_ms / 1000,
        wire_dtype="f16",
        eos_ids=frozenset(tokenizer.eos_ids),
    ) as pipe:
        for i, stage in enumerate(pipe.route.stages):
            say(
                f"  stage {i}: node {stage.node_key.hex()[:12]} layers {stage.layer_start}-"
                f"{stage.layer_end - 1}"
            )
        say(f"ready in {time.perf_counter() - t_start:.1f} s\n")
        messages = [{"role": "user", "content": args.prompt}]
        ids = tokenizer.encode_chat(messages)
        say(f"user: {args.prompt}\nassistant: ", end="")
        stream = tokenizer.stream(skip_special_tokens=True)

        async def on_tokens(tokens: list[int]) -> None:
            for t in tokens:
                sys.stdout.write(stream.push(t))
            sys.stdout.flush()

        request = GenerationRequest(
            prompt=ids,
            max_tokens=args.max_tokens,
            sampling=Sampling(temperature=args.temperature, seed=args.seed),
            spec=SpecConfig(strategy=args.strategy),
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
    say("stopped all nodes cleanly")
    return 0
