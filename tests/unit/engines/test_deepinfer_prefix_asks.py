"""What live sequences asked of DeepInfer's prefix cache, held until they are finalized: the
write decided at admission by the cache's keep rule, and the asks DeepInfer's sequences leave
behind when they end unfinalized (aborted while waiting, ignored) dropped."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deepinfer_server.engines.deepinfer import prefix_asks
from deepinfer_server.engines.deepinfer.prefix_asks import Ask, Asks, keepable_at_admission


class Status(enum.Enum):
    """The members of DeepInfer's `SequenceStatus` the asks read."""

    WAITING = 0
    RUNNING = 1
    FINISHED_ABORTED = 2
    FINISHED_IGNORED = 3
    FINISHED_PREEMPTED = 4
    FINISHED_SO_FAILED = 5
    FINISHED_VE_FAILED = 6


@dataclass
class Seq:
    """A sequence as far as the asks read it."""

    seq_id: int
    request_id: str
    status: Status = Status.WAITING


def test_a_retained_prompt_is_written_when_the_cache_would_keep_it() -> None:
    assert keepable_at_admission(256, text_only=True, min_tokens=256, prompt_limit=4096)
    assert not keepable_at_admission(255, text_only=True, min_tokens=256, prompt_limit=4096)
    assert not keepable_at_admission(300, text_only=False, min_tokens=256, prompt_limit=4096)
    assert not keepable_at_admission(5000, text_only=True, min_tokens=256, prompt_limit=4096)


def test_an_abort_drops_the_asks_of_the_waiting_sequences_it_reached() -> None:
    asks = Asks(Status)
    waiting, compiling, running = Seq(1, "a"), Seq(2, "b"), Seq(3, "a", Status.RUNNING)
    for seq in (waiting, compiling, running):
        asks.note(Ask(seq, b"salt", 300, 400))
    found = asks.waiting({"a", "b"})
    assert found == [1, 2]
    waiting.status = Status.FINISHED_ABORTED  # the abort reached it; "b" is in no queue yet
    running.status = Status.FINISHED_ABORTED  # finalized later, with its ask
    asks.drop_aborted(found)
    assert asks.get(1) is None and asks.get(2) is not None
    ask = asks.pop(3)
    assert ask is not None and (ask.salt, ask.retain_seconds, ask.written) == (b"salt", 300, 400)
    assert len(asks) == 1


def test_the_asks_of_ignored_sequences_are_pruned_once_there_are_many() -> None:
    asks = Asks(Status)
    count = prefix_asks._PRUNE_MIN + 1
    seqs = [Seq(number, f"r{number}", Status.RUNNING) for number in range(count)]
    for seq in seqs:
        asks.note(Ask(seq, None, 60, 300))
    for seq in seqs[: count // 2]:
        seq.status = Status.FINISHED_IGNORED
    asks.prune_if_due()
    assert len(asks) == count - count // 2
    assert asks.get(0) is None and asks.get(count - 1) is not None
