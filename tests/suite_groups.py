"""How long each group of `scripts/test` took, from a run's `--durations=0` report.

    scripts/test --durations=0 > suite.log 2>&1
    python -m tests.suite_groups suite.log            # from the repository root

It lives with the tests because it reads their groups (tests/conftest.py); scripts/ imports
no test module.

Sums the setup, call and teardown times of each test module and of each group of
tests/conftest.py (`serial-a`, `serial-b`: one worker each, one module after the other; the
rest: shared by both workers once their serial group is done), slowest modules first. The two
serial groups should be about equal (tests/conftest.py's `SECOND_GROUP` moves modules between
them); the wall of the run is about max(the larger serial group, half of the total).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re

from tests.conftest import SERIAL_GROUPS, xdist_group

ROOT = pathlib.Path(__file__).resolve().parents[1]

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=pathlib.Path, help="pytest output with --durations=0")
    parser.add_argument("--top", type=int, default=12, help="modules listed per group")
    args = parser.parse_args()
    modules: collections.Counter[str] = collections.Counter()
    for line in args.log.read_text().splitlines():
        if match := LINE.match(line):
            modules[match.group(2)] += float(match.group(1))
    groups: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in SERIAL_GROUPS}
    groups["rest"] = collections.Counter()
    for name, seconds in modules.items():
        group = xdist_group(ROOT / name)
        groups[group if group in SERIAL_GROUPS else "rest"][name] = seconds
    total = sum(modules.values())
    print(f"all tests: {total:.0f} s (half: {total / 2:.0f} s)")
    for group, members in groups.items():
        slowest = ", ".join(
            f"{n.removeprefix('tests/')} {s:.0f}" for n, s in members.most_common(args.top)
        )
        print(f"{group}: {sum(members.values()):.0f} s in {len(members)} modules; {slowest}")


if __name__ == "__main__":
    main()
