"""A Responses batch whose lines all append to one conversation, its server killed (kill -9)
while it works and restarted on the same SQLite store, until the batch completes: what the
exactly-once test (`tests/e2e/test_batch_exactly_once.py`) asserts on, and what
`bench/batch_exactly_once.py` prints for the full run.

A kill is aimed at the moment a line's writes are committed and its result is not recorded
yet (seen in the store: more turns appended than lines recorded), the window in which a line
used to be answered twice; when that moment is not seen in time, the kill lands once a share
of the lines is recorded.
"""

from __future__ import annotations

import io
import re
import signal
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai
import orjson

from tests.server import LiveServer, wait_until

MODEL = "deepseek-flash"
#: The simulated model at 20 ms a token, four lines at once: a line takes a few tenths of a second.
SERVER_ARGS = ("--sim-ttft-ms", "5", "--sim-itl-ms", "20", "--batch-concurrency", "4")
_LINE = re.compile(r"batch-line-(\d+)\b")
#: Seconds a kill waits for a line between its writes and its record before it lands anyway.
_AIM = 6.0


@dataclass
class KilledBatch:
    """What a killed batch left: its lines as the output file lists them, the turns its
    conversation holds by line, and how many kills landed in a line's window."""

    lines: int
    output_ids: Counter[str] = field(default_factory=Counter)
    turns: Counter[int] = field(default_factory=Counter)
    kills: int = 0
    in_window: int = 0
    succeeded: int = 0
    #: The lines whose writes carry their mark in the store (`store/batch_effects.py`).
    marked: int = 0

    @property
    def duplicated(self) -> int:
        """Turns appended more than once (the extra appends)."""
        return sum(count - 1 for count in self.turns.values() if count > 1)

    def report(self) -> str:
        """The counts, one line each."""
        return "\n".join(
            [
                f"lines: {self.lines}, kills: {self.kills} ({self.in_window} in a line's window)",
                f"custom_ids in the output: {len(self.output_ids)} distinct, "
                f"{sum(self.output_ids.values())} in all, {self.succeeded} succeeded",
                f"turns in the conversation: {sum(self.turns.values())} "
                f"({len(self.turns)} lines), duplicated appends: {self.duplicated}, "
                f"lines marked: {self.marked}",
            ]
        )


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _input(lines: int, conversation: str) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/responses",
                "body": {
                    "model": MODEL,
                    "input": f"batch-line-{n} please answer",
                    "conversation": conversation,
                    "max_output_tokens": 8,
                },
            }
        )
        + b"\n"
        for n in range(lines)
    )


def _turns(store: Path, conversation: str) -> Counter[int]:
    """The turns appended to the conversation, by line (its user items)."""
    with sqlite3.connect(store, timeout=5) as db:
        rows = db.execute(
            "SELECT body FROM conversation_items WHERE conversation_id = ?", (conversation,)
        ).fetchall()
    db.close()
    turns: Counter[int] = Counter()
    for (body,) in rows:
        item = orjson.loads(body)
        found = _LINE.search(orjson.dumps(item.get("content")).decode())
        if item.get("role") == "user" and found:
            turns[int(found.group(1))] += 1
    return turns


def _recorded(store: Path, batch_id: str) -> set[int]:
    """The lines whose result is recorded."""
    with sqlite3.connect(store, timeout=5) as db:
        rows = db.execute(
            "SELECT line FROM batch_lines WHERE batch_id = ? AND status != 'pending'",
            (batch_id,),
        ).fetchall()
    db.close()
    return {int(row[0]) for row in rows}


def _unrecorded(store: Path, batch_id: str, conversation: str) -> set[int]:
    """The lines whose turn is appended and whose result is not recorded."""
    return set(_turns(store, conversation)) - _recorded(store, batch_id)


def _kill_when_aimed(server: LiveServer, store: Path, batch: str, conv: str, floor: int) -> bool:
    """Kill the server while a line it answered is in its window (appended, not recorded),
    or once `floor` lines are recorded past `_AIM` seconds; whether it landed in a window."""
    left = _unrecorded(store, batch, conv)  # by the server killed before: not this one's
    deadline = time.monotonic() + _AIM
    while True:
        in_window = bool(_unrecorded(store, batch, conv) - left)
        if in_window or (time.monotonic() > deadline and len(_recorded(store, batch)) >= floor):
            server.stop(signal.SIGKILL)
            return in_window
        time.sleep(0.002)


def run_killed_batch(state: Path, lines: int, kills: int, timeout: float = 600) -> KilledBatch:
    """Run a batch of `lines` appending to one conversation, killing its server `kills`
    times (restarted on the same store each time), to the end; what it left."""
    store, args = state / "responses.sqlite3", (*SERVER_ARGS, "--state-dir", str(state))
    outcome = KilledBatch(lines)
    with LiveServer(*args) as server, _client(server) as client:
        conversation = client.conversations.create().id
        upload = client.files.create(
            file=("in.jsonl", io.BytesIO(_input(lines, conversation))), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h"
        )
        floor = lines // (kills + 1)
        outcome.in_window += _kill_when_aimed(server, store, batch.id, conversation, floor)
    for kill in range(1, kills + 1):
        with LiveServer(*args) as server, _client(server) as client:
            if kill < kills:
                floor = lines * (kill + 1) // (kills + 1)
                outcome.in_window += _kill_when_aimed(server, store, batch.id, conversation, floor)
                continue
            wait_until(
                lambda: client.batches.retrieve(batch.id).status == "completed",
                timeout,
                "the batch to complete after the last restart",
            )
            done = client.batches.retrieve(batch.id)
            assert done.output_file_id is not None
            for text in client.files.content(done.output_file_id).text.splitlines():
                line = orjson.loads(text)
                outcome.output_ids[line["custom_id"]] += 1
                outcome.succeeded += line["response"]["status_code"] == 200
    outcome.kills = kills
    outcome.turns = _turns(store, conversation)
    with sqlite3.connect(store, timeout=5) as db:
        marked = db.execute(
            "SELECT COUNT(*) FROM batch_line_effects WHERE batch_id = ?", (batch.id,)
        ).fetchall()
    db.close()
    outcome.marked = int(marked[0][0])
    return outcome
