"""Agent traces against DeepInfer's own scheduler with the server's prefix cache (twin side).

Imported inside a twin process (`run_in_twin`) that built the engine with the cache. A trace is
a list of actions at iterations of the server's engine driver: turns of a few conversations
(a fresh conversation over a shared system prompt; an extension of the last turn, a byte
prefix; a thinking-mode turn, which shares all but the last token of the earlier prompt; a
branch from an older turn; an identical retry; a sibling, which continues another
conversation's last turn, so that several forks of one entry run at once) and aborts of live
requests. Checked:

- after every iteration: the twin worker's KV check (each scheduled sequence's blocks and
  state slot hold exactly its own token prefix) and the reference-count ledger (each block's
  and state slot's count equals the sequences, cached entries, snapshots and pending clone
  releases that hold it);
- every answer is its own prompt's (the twin model's script): a fork prefilled the new prompt
  and its output arrived under the new request's ID;
- at the end, with the cache cleared: every block and state slot free again, no bookkeeping left.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepinfer_server.engines.simulated.script import ScriptWriter
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, SamplingOptions

SHAPES = ("fresh", "extend", "thinking", "branch", "retry", "sibling")
#: Agents mostly extend their conversation: most turns can hit.
WEIGHTED_SHAPES = ("extend", "extend", "extend", "thinking", "thinking", *SHAPES)
_SPOKEN = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
)
WORDS = tuple(_SPOKEN.split())


@dataclass(frozen=True)
class Action:
    """One step of a trace, at iteration `at` of the driver (or later, if it must wait)."""

    at: int
    kind: str  # "turn" or "abort"
    conversation: int = 0
    shape: str = "extend"
    words: int = 20
    max_tokens: int = 16
    ignore_eos: bool = False
    #: Which live request an abort hits (0: the newest; modulo their count).
    victim: int = 0


@dataclass
class Turn:
    prompt: list[int]
    request_id: str
    conversation: int
    max_tokens: int
    ignore_eos: bool
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    aborted: bool = False
    reused: int = 0
    #: When it ended (a count over the trace), 0 while live.
    ended: int = 0


@dataclass
class Report:
    """What a trace did: requests, cache hits (tokens reused) and evictions."""

    requests: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    preempted: int = 0
    aborted: int = 0
    #: The most forks of one entry alive at once.
    concurrent_forks: int = 0


def random_actions(rng: random.Random, count: int, conversations: int = 3) -> list[Action]:
    """A trace without hypothesis (for DP ranks, which must iterate in lockstep)."""
    actions = []
    at = 0
    for _ in range(count):
        abort = rng.random() < 0.2
        # As in action_strategy: half the aborts in the iteration of the action before them.
        at += 0 if abort and rng.random() < 0.5 else rng.randint(0, 12)
        if abort:
            actions.append(Action(at, "abort", victim=rng.randint(0, 3)))
            continue
        actions.append(
            Action(
                at,
                "turn",
                conversation=rng.randrange(conversations),
                shape=rng.choice(WEIGHTED_SHAPES),
                words=rng.randint(3, 60),
                max_tokens=rng.choice([1, 2, 8, 30, 80, 200]),
                ignore_eos=rng.random() < 0.2,
            )
        )
    return actions


def action_strategy(conversations: int = 3) -> Any:
    """A hypothesis strategy of traces over `conversations` conversations (hypothesis is
    imported here: only the twin process needs it)."""
    from hypothesis import strategies as st

    turn = st.builds(
        lambda gap, conversation, shape, words, max_tokens, ignore_eos: (
            gap,
            Action(0, "turn", conversation, shape, words, max_tokens, ignore_eos),
        ),
        st.integers(0, 12),
        st.integers(0, conversations - 1),
        st.sampled_from(WEIGHTED_SHAPES),
        st.integers(3, 60),
        st.sampled_from([1, 2, 8, 30, 80, 200]),
        st.booleans(),
    )
    # Half the aborts come in the same iteration as the action before them (a fork that has
    # not been prefilled yet), most hit one of the newest requests.
    abort = st.builds(
        lambda gap, victim: (gap, Action(0, "abort", victim=victim)),
        st.one_of(st.just(0), st.integers(0, 12)),
        st.integers(0, 3),
    )
    steps = st.lists(st.one_of(turn, turn, turn, abort), min_size=6, max_size=16)

    def absolute(pairs: list[tuple[int, Action]]) -> list[Action]:
        at, actions = 0, []
        for gap, action in pairs:
            at += gap
            actions.append(Action(at, *_fields(action)))
        return actions

    return steps.map(absolute)


#: Traces every run plays first (hypothesis `example`s): what random traces reach rarely.
EXPLICIT_TRACES = (
    # Two forks of one entry at once (a conversation's next turn and a sibling), one aborted
    # before its prefill, the other while decoding.
    [
        Action(0, "turn", 0, "fresh", 20, 8),
        Action(30, "turn", 0, "extend", 20, 80, ignore_eos=True),
        Action(30, "turn", 1, "sibling", 20, 80, ignore_eos=True),
        Action(30, "abort", victim=0),
        Action(40, "abort", victim=0),
        Action(41, "turn", 2, "thinking", 10, 2),
    ],
)

#: With the host tier, in a small pool: four conversations push the first ones out of the pool
#: (to host memory); their next turns are restored, one aborted at once (a restore still
#: waiting for its prefill), one while decoding.
HOST_TRACES = (
    [
        Action(0, "turn", 0, "fresh", 40, 8),
        Action(20, "turn", 1, "fresh", 40, 8),
        Action(40, "turn", 2, "fresh", 40, 8),
        Action(60, "turn", 3, "fresh", 40, 8),
        Action(80, "turn", 0, "extend", 20, 8),
        Action(80, "abort", victim=0),
        Action(90, "turn", 1, "extend", 20, 80, ignore_eos=True),
        Action(92, "abort", victim=0),
        Action(100, "turn", 2, "thinking", 20, 8),
        Action(120, "turn", 0, "extend", 20, 8),
    ],
)


def _fields(action: Action) -> tuple[Any, ...]:
    return (
        action.kind,
        action.conversation,
        action.shape,
        action.words,
        action.max_tokens,
        action.ignore_eos,
        action.victim,
    )


class TraceRunner:
    """Plays traces through the server's engine driver on the twin's LLMEngine."""

    def __init__(self, engine: Any, driver: Any, tokenizer: Any, system_words: int = 120) -> None:
        self.engine = engine
        self.driver = driver
        self.tokenizer = tokenizer
        self.script = ScriptWriter(tokenizer)
        ids = {name: tokenizer.token_to_id(name) for name in _SPECIAL}
        self.bos, self.eos = ids["<｜begin▁of▁sentence｜>"], ids["<｜end▁of▁sentence｜>"]
        self.user, self.assistant = ids["<｜User｜>"], ids["<｜Assistant｜>"]
        self.think, self.end_think = ids["<think>"], ids["</think>"]
        rng = random.Random(7)
        self.system = self._encode(" ".join(rng.choice(WORDS) for _ in range(system_words)))
        self.serial = 0

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def words(self, text: str, count: int | None = None) -> list[int]:
        """`text`'s token IDs, without special tokens; with `count`, the first `count` of
        `text` repeated `count` times (a prompt of a chosen length)."""
        if count is None:
            return self._encode(text)
        return self._encode(" ".join([text] * count))[:count]

    # The trace

    def run(self, actions: list[Action], seed: int = 0, iterations: int | None = None) -> Report:
        """Play `actions`, then run until no DP rank has work. `iterations` fixes how many
        iterations the actions get (DP ranks must iterate in lockstep); actions that still
        wait then are dropped."""
        rng = random.Random(seed)
        report = Report()
        history: dict[int, list[Turn]] = {}
        live: dict[str, Turn] = {}
        waiting = sorted(actions, key=lambda action: action.at)
        last = max((action.at for action in actions), default=0)
        if iterations is not None:
            assert last < iterations, "an action after the trace's last iteration"
            last = iterations - 1
        evictions = self.engine.prefix_cache.evictions
        preempted = self.engine.scheduler.get_num_preempted_seqs()
        for iteration in range(last + 1):
            still = []
            for action in waiting:
                if action.at > iteration or not self._act(action, history, live, rng, report):
                    still.append(action)
            waiting = still
            self._iterate(live, history)
        for _ in range(4000):
            if not self._iterate(live, history):
                break
        assert not live, f"requests never finished: {sorted(live)}"
        report.evictions = self.engine.prefix_cache.evictions - evictions
        report.preempted = self.engine.scheduler.get_num_preempted_seqs() - preempted
        for turns in history.values():
            for turn in turns:
                self._check_answer(turn)
        return report

    def _act(
        self,
        action: Action,
        history: dict[int, list[Turn]],
        live: dict[str, Turn],
        rng: random.Random,
        report: Report,
    ) -> bool:
        """Do `action` now; False when it must wait (its conversation's turn is running)."""
        if action.kind == "abort":
            if live:
                victims = list(live)[::-1]  # newest first: a fork still waiting, often
                request_id = victims[action.victim % len(victims)]
                live[request_id].aborted = True
                self.driver.abort([request_id])
                report.aborted += 1
                # The driver forgets an aborted request at once: nothing more comes for it.
                self._end(live.pop(request_id), history)
            return True
        if any(turn.conversation == action.conversation for turn in live.values()):
            return False
        turns = history.get(action.conversation, [])
        if action.shape == "sibling":
            # Continue the turn that ended last, in another conversation: with that
            # conversation's own next turn, two forks of one entry run at once.
            others = [t for c, ts in history.items() if c != action.conversation for t in ts]
            turns = [max(others, key=lambda turn: turn.ended)] if others else turns
        prompt = self._prompt(action, turns, rng)
        if len(prompt) + action.max_tokens > self.engine.prefix_cache._prompt_limit:
            # The server refuses such a request before the engine; a new conversation instead.
            history.pop(action.conversation, None)
            prompt = self._prompt(action, [], rng)
        self.serial += 1
        turn = Turn(
            prompt,
            f"c{action.conversation}-t{self.serial}",
            action.conversation,
            action.max_tokens,
            action.ignore_eos,
        )
        before = self.engine.prefix_cache.hit_tokens
        rejected = self.driver.add(
            AddRequest(
                turn.request_id,
                pack_token_ids(prompt),
                SamplingOptions(max_tokens=action.max_tokens, ignore_eos=action.ignore_eos),
            )
        )
        assert rejected is None, rejected
        turn.reused = self.engine.prefix_cache.hit_tokens - before
        assert turn.reused <= len(prompt) - 2, "a fork must compute at least two tokens"
        report.requests += 1
        if turn.reused:
            report.hits += 1
            report.reused_tokens += turn.reused
            index = self.engine.prefix_cache.index  # empty after a restore from host memory
            forks = max((entry.live_forks for entry in index), default=0)
            report.concurrent_forks = max(report.concurrent_forks, forks)
        live[turn.request_id] = turn
        return True

    def _prompt(self, action: Action, turns: list[Turn], rng: random.Random) -> list[int]:
        words = self._encode(" ".join(rng.choice(WORDS) for _ in range(action.words)))
        question = [self.user, *words, self.assistant]
        done = [turn for turn in turns if turn.finish is not None or turn.aborted]
        if action.shape == "fresh" or not done:
            return [self.bos, *self.system, *question, rng.choice([self.think, self.end_think])]
        if action.shape == "retry":
            return list(done[-1].prompt)
        base = rng.choice(done) if action.shape == "branch" else done[-1]
        if action.shape == "thinking":
            # The earlier prompt ended with <think>; the next renders </think> there instead.
            earlier = [*base.prompt[:-1], self.end_think, *base.tokens, self.eos]
            return [*earlier, *question, self.think]
        return [*base.prompt, *base.tokens, self.eos, *question, self.end_think]

    def _iterate(self, live: dict[str, Turn], history: dict[int, list[Turn]]) -> bool:
        unfinished, deltas = self.driver.iterate()
        for delta in deltas:
            turn = live.get(delta.request_id)
            assert turn is not None, f"output for {delta.request_id}, which is not live"
            turn.tokens.extend(delta.tokens.token_ids)
            if delta.finish is not None:
                turn.finish = delta.finish.name
                self._end(live.pop(delta.request_id), history)
        problems = list(self.engine.driver_worker.cache_engine.violations)
        problems += ledger_problems(self.engine)
        assert not problems, "\n".join(problems)
        return bool(unfinished)

    def _end(self, turn: Turn, history: dict[int, list[Turn]]) -> None:
        self.serial += 1
        turn.ended = self.serial
        history.setdefault(turn.conversation, []).append(turn)

    def _check_answer(self, turn: Turn) -> None:
        script = self.script.answer_tokens(turn.prompt)
        if turn.ignore_eos:
            period = len(script) + 1
            cycle = [i % period for i in range(turn.max_tokens)]
            expected = [script[at] for at in cycle if at < len(script)]
        else:
            expected = script[: turn.max_tokens]
        name = f"{turn.request_id} (reused {turn.reused} of {len(turn.prompt)})"
        if turn.aborted:
            assert turn.tokens == expected[: len(turn.tokens)], f"{name}: wrong partial answer"
            return
        assert turn.finish in ("STOP", "LENGTH"), f"{name}: finished {turn.finish}"
        assert turn.tokens == expected, f"{name}: answered another prompt"

    # Quiescence

    def baseline_problems(self) -> list[str]:
        """With no request left: clear the cache; every block and slot must be free again."""
        engine = self.engine
        engine.clear_prefix_cache()
        cache = engine.prefix_cache
        problems = []
        free_blocks = engine.scheduler.get_num_free_gpu_blocks()
        if free_blocks != engine.cache_config.num_gpu_blocks - 1:
            problems.append(f"{free_blocks} of {engine.cache_config.num_gpu_blocks - 1} free")
        free_states = engine.state_manager.get_num_free_blocks()
        if free_states != engine.cache_config.num_state_seqs - 1:
            problems.append(f"{free_states} of {engine.cache_config.num_state_seqs - 1} slots free")
        left = {
            "pending": cache.snapshots.pending,
            "snapshots": cache.snapshots.taken,
            "waiting forks": cache.forks.waiting,
            "forks": cache.forks.live,
        }
        problems += [f"{name} left: {list(held)}" for name, held in left.items() if held]
        return problems + ledger_problems(engine)


_SPECIAL = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
)


def capture_added(engine: Any) -> dict[str, Any]:
    """Keep every sequence `engine.add_request` returns, by request ID, in the dict returned
    (a scenario reads what its requests became: a fork, a restore, their cached tokens)."""
    returned: dict[str, Any] = {}
    add_request = engine.add_request

    def capture(*args: Any, **kwargs: Any) -> Any:
        seq = add_request(*args, **kwargs)
        returned[args[1]] = seq
        return seq

    engine.add_request = capture
    return returned


def ledger_problems(engine: Any) -> list[str]:
    """Blocks and state slots whose reference count is not the number of their holders.

    Holders between steps: every sequence in the scheduler's queues with a block table (a
    preempted or freed one has none: its stale `state_id` holds nothing), every cached entry,
    every snapshot, and the clone sources a step has yet to release.
    """
    from deepinfer._C import twin_probe

    scheduler = engine.scheduler
    cache = engine.prefix_cache
    blocks: Counter[int] = Counter()
    states: Counter[int] = Counter()
    holders = [*scheduler.waiting, *scheduler.running, *(entry.value for entry in cache.index)]
    for seq in holders:
        table = list(twin_probe.block_table(seq))
        if table:
            blocks.update(table)
            states[int(seq.state_id)] += 1
    for _seq, slot in cache.snapshots.taken.values():
        states[slot] += 1
    pending = engine.deferred_release.clone_unpins_to_release
    if pending is not None:
        states.update(int(s) for s in np.asarray(pending[0]))
        blocks.update(int(b) for b in np.asarray(pending[1]))
    problems = []
    for name, manager, held in (
        ("block", engine.block_manager, blocks),
        ("state slot", engine.state_manager, states),
    ):
        counts = list(twin_probe.ref_counts(manager))
        for index in range(1, len(counts)):
            if counts[index] != held.get(index, 0):
                problems.append(
                    f"{name} {index}: reference count {counts[index]}, held {held.get(index, 0)}"
                )
        if held.get(0) or any(key >= len(counts) for key in held):
            problems.append(f"{name}s held outside the pool: {sorted(held)}")
    return problems
