"""PrefixDirectory: block hashes of prompt prefixes, what each rank is believed to hold, and
forgetting beyond what the rank reports it caches."""

from __future__ import annotations

import random

from deepinfer_server.coordinator.prefix_directory import PrefixDirectory
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.model.kv_block import BLOCK_SIZE

SLOTS = 2


def _prompt(length: int, seed: int = 0) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(129_280) for _ in range(length)]


def _directory(ranks: int = 2) -> PrefixDirectory:
    directory = PrefixDirectory(ranks, max_model_len=32_768, running_slots=SLOTS)
    for rank in range(ranks):
        directory.rank_holds(rank, sequences=0)
    return directory


def test_a_prompt_hashes_each_whole_block_prefix_and_an_extension_keeps_them() -> None:
    directory = _directory()
    turn = _prompt(1000)
    hashes = directory.block_hashes(pack_token_ids(turn))
    assert len(hashes) == 1000 // BLOCK_SIZE == 7  # the partial last block is not hashed
    longer = directory.block_hashes(pack_token_ids([*turn, *_prompt(300, seed=1)]))
    assert longer[:7] == hashes and len(longer) == 10
    changed = list(turn)
    changed[3 * BLOCK_SIZE + 5] += 1  # one token of the fourth block
    other = directory.block_hashes(pack_token_ids(changed))
    assert other[:3] == hashes[:3]
    assert all(a != b for a, b in zip(other[3:], hashes[3:], strict=True))
    assert directory.block_hashes(pack_token_ids(turn[:100])) == []


def test_a_prefix_is_held_only_under_the_cache_salt_it_was_routed_with() -> None:
    directory = _directory()
    turn_1 = _prompt(2000)
    directory.record(1, "turn-1", directory.block_hashes(pack_token_ids(turn_1), b"a"))
    turn_2 = pack_token_ids([*turn_1, *_prompt(300, seed=2)])
    held = 2000 // BLOCK_SIZE * BLOCK_SIZE
    assert directory.held_tokens(directory.block_hashes(turn_2, b"a")) == [0, held]
    assert directory.held_tokens(directory.block_hashes(turn_2, b"b")) == [0, 0]
    assert directory.held_tokens(directory.block_hashes(turn_2)) == [0, 0]


def test_a_rank_holds_the_prefix_of_the_prompts_routed_to_it() -> None:
    directory = _directory()
    turn_1 = _prompt(14_000)
    directory.record(1, "turn-1", directory.block_hashes(pack_token_ids(turn_1)))
    turn_2 = [*turn_1, *_prompt(300, seed=2)]
    held = directory.held_tokens(directory.block_hashes(pack_token_ids(turn_2)))
    assert held == [0, 14_000 // BLOCK_SIZE * BLOCK_SIZE]
    stranger = directory.block_hashes(pack_token_ids(_prompt(14_000, seed=3)))
    assert directory.held_tokens(stranger) == [0, 0]


def test_a_rank_that_reported_no_cache_is_believed_to_hold_nothing() -> None:
    directory = PrefixDirectory(2, max_model_len=32_768, running_slots=SLOTS)
    directory.rank_holds(0, sequences=0)
    hashes = directory.block_hashes(pack_token_ids(_prompt(1024)))
    directory.record(0, "a", hashes)
    directory.record(1, "b", hashes)  # rank 1 never reported a prefix cache
    assert directory.held_tokens(hashes) == [1024, 0]


def test_beyond_what_the_rank_caches_the_least_recently_routed_prompts_are_forgotten() -> None:
    directory = _directory(ranks=1)
    prompts = [_prompt(512, seed=seed) for seed in range(4)]
    hashes = [directory.block_hashes(pack_token_ids(prompt)) for prompt in prompts]
    for number, prompt_hashes in enumerate(hashes):
        directory.record(0, f"r{number}", prompt_hashes)
    # No cached sequences reported: only what the rank can be running (2) is remembered.
    assert directory.entries(0) == SLOTS
    assert [directory.held_tokens(h) for h in hashes] == [[0], [0], [512], [512]]
    directory.rank_holds(0, sequences=3)
    directory.record(0, "r0-again", hashes[0])
    assert directory.entries(0) == 3
    assert [directory.held_tokens(h)[0] for h in hashes] == [512, 0, 512, 512]
    directory.rank_holds(0, sequences=0)  # the rank's cache was emptied
    assert directory.entries(0) == SLOTS
    assert [directory.held_tokens(h)[0] for h in hashes] == [512, 0, 0, 512]


def test_shared_prefixes_stay_while_any_prompt_holding_them_is_remembered() -> None:
    directory = _directory(ranks=1)
    directory.rank_holds(0, sequences=1)  # three remembered: one cached, two running
    system = _prompt(1024)
    first = directory.block_hashes(pack_token_ids([*system, *_prompt(256, seed=1)]))
    second = directory.block_hashes(pack_token_ids([*system, *_prompt(256, seed=2)]))
    directory.record(0, "a", first)
    directory.record(0, "b", second)
    directory.rank_holds(0, sequences=0)  # down to two, then:
    directory.record(0, "c", directory.block_hashes(pack_token_ids(_prompt(512, seed=3))))
    # "a" is forgotten; the shared system prompt is still held through "b".
    assert directory.held_tokens(first) == [1024]
    assert directory.held_tokens(second) == [1280]
