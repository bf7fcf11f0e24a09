#!/usr/bin/env python3
"""Exactly-once batch lines under kill -9: the full check behind the e2e test.

    python bench/batch_exactly_once.py [--lines 400] [--kills 5]

One simulated server on an SQLite store in a temporary directory runs a Responses batch of
--lines lines that all append to one conversation. It is killed with SIGKILL --kills times,
each kill aimed at a line whose turn is appended and whose result is not recorded yet (the
window in which a line used to be answered twice), and restarted on the same store each time;
after the last restart the batch runs to the end. Printed: the kills and how many landed in a
line's window, the custom_ids in the output file (distinct, in all, succeeded) and the turns
in the conversation with the duplicated appends. Exits 1 when a custom_id is missing or
repeated or a turn was appended twice (or not at all).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.batch_kills import run_killed_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400, help="lines of the batch")
    parser.add_argument("--kills", type=int, default=5, help="kill -9 of the server, then restart")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        outcome = run_killed_batch(Path(directory), args.lines, args.kills, timeout=1800)
    print(outcome.report())
    exact = (
        all(count == 1 for count in outcome.output_ids.values())
        and len(outcome.output_ids) == args.lines
        and outcome.succeeded == args.lines
        and outcome.turns.keys() == set(range(args.lines))
        and outcome.duplicated == 0
    )
    print("exactly once" if exact else "NOT exactly once")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
