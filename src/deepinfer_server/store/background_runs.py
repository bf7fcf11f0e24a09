"""BackgroundRuns: the store's side of background responses (`services/background.py`): a response
stored as it starts, its stream's events (`response_events`), and its run (`background_runs`:
the process running it, under a lease its heartbeats renew) until it ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import orjson

from deepinfer_server.store.database import Step
from deepinfer_server.store.records import JsonObject, NewResponse
from deepinfer_server.store.response_rows import ResponseRows, output_items
from deepinfer_server.store.response_tables import RUN_LEASE


class BackgroundRuns(ResponseRows):
    """The responses' writes with the background runs' (the base of `ResponseStore`)."""

    async def start_background(
        self, response: NewResponse, owner: str, events: Sequence[tuple[int, str]] = ()
    ) -> None:
        """Store a background response as it starts (its input items, no output yet, the
        first `events` of its stream), run by `owner` (a process: `heartbeat` says it still
        runs it)."""
        steps = await self.insert_steps(response)
        steps.append(
            Step(
                "INSERT INTO background_runs (response_id, scope, owner, heartbeat_at) "
                "VALUES (?, ?, ?, ?)",
                (response.id, response.scope, owner, RUN_LEASE.stamp(time.time())),
            )
        )
        if events:
            steps.append(
                Step(
                    "INSERT INTO response_events (response_id, sequence_number, body) "
                    "VALUES (?, ?, ?)",
                    [(response.id, number, text) for number, text in events],
                    many=True,
                )
            )
        async with self._failures("store a background response", write=True):
            await self._db.write(steps)

    async def record_progress(
        self, response_id: str, body: JsonObject | None, events: Sequence[tuple[int, str]]
    ) -> None:
        """Append a background response's stream events (sequence number, JSON) and, with
        `body`, replace its response object (its status), in one transaction."""
        steps = []
        added = sum(len(text) for _, text in events)
        if body is not None:
            text = orjson.dumps(body).decode()
            added += len(text)
            steps.append(Step("UPDATE responses SET body = ? WHERE id = ?", (text, response_id)))
        if events:
            # Only while it runs: a response deleted or evicted meanwhile keeps no events.
            steps.append(
                Step(
                    "INSERT INTO response_events (response_id, sequence_number, body) "
                    "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM background_runs "
                    "WHERE response_id = ?) ON CONFLICT (response_id, sequence_number) DO NOTHING",
                    [(response_id, number, text, response_id) for number, text in events],
                    many=True,
                )
            )
        if not steps:
            return
        steps.append(
            Step("UPDATE responses SET bytes = bytes + ? WHERE id = ?", (added, response_id))
        )
        async with self._failures("record a background response's progress", write=True):
            await self._db.write(steps)

    async def claim_run(
        self, response_id: str, owner: str, *, stale_before: float | None = None
    ) -> bool:
        """Take the run of a background response for `owner`: when `owner` runs it already
        (its lease renewed), or its owner's last heartbeat is older than `stale_before` (by
        default, `lease.LEASE` ago: a process that died). False when the run is gone (ended,
        deleted) or another process holds it."""
        now = time.time()
        cutoff = RUN_LEASE.cutoff(now) if stale_before is None else stale_before
        assign, values = RUN_LEASE.take(owner, RUN_LEASE.stamp(now))
        where, params = RUN_LEASE.takeable(owner, cutoff)
        async with self._failures("claim a background response", write=True):
            await self._prepare()
            changed = await self._db.write(
                [
                    Step(
                        f"UPDATE background_runs SET {assign} WHERE response_id = ? AND {where}",
                        (*values, response_id, *params),
                    )
                ]
            )
        return changed[0] > 0

    async def finish_background(
        self, response_id: str, scope: str, body: JsonObject, events: Sequence[tuple[int, str]]
    ) -> None:
        """A background response ended: its last events, its final object and output items;
        its run is over. Call it after `claim_run` (this writes whatever the run holds)."""
        outputs = [orjson.dumps(item).decode() for item in output_items(body)]
        text = orjson.dumps(body).decode()
        added = len(text) + sum(len(item) for item in outputs)
        added += sum(len(event) for _, event in events)
        async with self._failures("finish a background response", write=True):
            await self._prepare()
            found = await self._db.fetch(
                "SELECT input_count FROM responses WHERE id = ?", (response_id,)
            )
            if not found:
                return  # deleted meanwhile
            first = int(found[0][0])
            steps = [
                Step(
                    "UPDATE responses SET body = ?, bytes = bytes + ? WHERE id = ?",
                    (text, added, response_id),
                ),
                Step("DELETE FROM background_runs WHERE response_id = ?", (response_id,)),
            ]
            if outputs:
                steps.append(
                    Step(
                        "INSERT INTO items (response_id, position, item_id, scope, body) "
                        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (response_id, position) DO NOTHING",
                        [
                            (response_id, first + index, str(item.get("id", "")), scope, row)
                            for index, (item, row) in enumerate(
                                zip(output_items(body), outputs, strict=True)
                            )
                        ],
                        many=True,
                    )
                )
            if events:
                steps.append(
                    Step(
                        "INSERT INTO response_events (response_id, sequence_number, body) "
                        "VALUES (?, ?, ?) ON CONFLICT (response_id, sequence_number) DO NOTHING",
                        [(response_id, number, event) for number, event in events],
                        many=True,
                    )
                )
            await self._db.write(steps)

    async def heartbeat(self, owner: str) -> None:
        """`owner` still runs its background responses: their lease is renewed."""
        assign, values = RUN_LEASE.renew(RUN_LEASE.stamp(time.time()))
        async with self._failures("renew background runs", write=True):
            await self._prepare()
            await self._db.write(
                [Step(f"UPDATE background_runs SET {assign} WHERE owner = ?", (*values, owner))]
            )

    async def request_cancel(self, response_id: str) -> bool:
        """Ask the process running a background response to cancel it (`runs_of`);
        False when it runs no more."""
        async with self._failures("cancel a background response", write=True):
            await self._prepare()
            changed = await self._db.write(
                [
                    Step(
                        "UPDATE background_runs SET cancel_requested = 1 WHERE response_id = ?",
                        (response_id,),
                    )
                ]
            )
        return changed[0] > 0

    async def runs_of(self, owner: str) -> dict[str, bool]:
        """The background responses `owner` runs, each with whether it was asked to be
        cancelled (a run missing here was deleted, evicted, or taken for dead)."""
        async with self._failures("read background runs"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT response_id, cancel_requested FROM background_runs WHERE owner = ?",
                (owner,),
            )
        return {str(found): bool(asked) for found, asked in rows}

    async def last_event(self, response_id: str) -> int | None:
        """The sequence number of a response's last stored event (None: it has none)."""
        async with self._failures("read a response's events"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT MAX(sequence_number) FROM response_events WHERE response_id = ?",
                (response_id,),
            )
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    async def stale_runs(self, stale_before: float | None = None) -> list[tuple[str, str]]:
        """(response ID, scope) of the background runs whose owner's last heartbeat is older
        than `stale_before` (by default, `lease.LEASE` ago)."""
        where, params = RUN_LEASE.ended(
            RUN_LEASE.cutoff(time.time()) if stale_before is None else stale_before
        )
        async with self._failures("list background runs"):
            await self._prepare()
            rows = await self._db.fetch(
                f"SELECT response_id, scope FROM background_runs WHERE {where}", params
            )
        return [(str(found), str(scope)) for found, scope in rows]

    async def events_after(
        self, response_id: str, after: int, limit: int = 1000
    ) -> list[tuple[int, str]]:
        """A background response's stored stream events past sequence number `after`, in
        order (at most `limit`)."""
        async with self._failures("read a response's events"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT sequence_number, body FROM response_events WHERE response_id = ? "
                "AND sequence_number > ? ORDER BY sequence_number LIMIT ?",
                (response_id, after, limit),
            )
        return [(int(number), str(body)) for number, body in rows]
