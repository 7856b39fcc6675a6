"""examples/agent_loop.py runs its whole loop (call → result → answer) against meshd's API.

The model is the tiny random model of tests/api/test_tools.py, whose tokenizer carries a
Hermes-style tool template (SmolLM2's and the built-in model's templates do not render tools):
its words mean nothing, but its calls are real calls under the tool grammar, so the loop runs
as with a trained model.
"""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.api.test_tools import tiny_url  # noqa: F401  (the served model, a fixture)
from tests.node.daemons import REPO

EXAMPLE = REPO / "examples" / "agent_loop.py"


def test_the_agent_loop_calls_the_tool_and_answers_with_its_result(tiny_url: str) -> None:  # noqa: F811
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--base-url", tiny_url, "--require-tool", "Oslo?"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    calls = [i for i, line in enumerate(lines) if line.startswith("[tool] get_weather(")]
    assert calls, done.stdout
    # The example ran the tool with the model's arguments (valid for its schema).
    arguments = ast.literal_eval(lines[calls[0]].removeprefix("[tool] get_weather(")[:-1])
    assert set(arguments) <= {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    # After the result went back, the loop ended on a text answer, not on the rounds limit.
    answer = "\n".join(lines[calls[-1] + 1 :])
    assert answer.strip() and "no answer within the rounds allowed" not in answer
