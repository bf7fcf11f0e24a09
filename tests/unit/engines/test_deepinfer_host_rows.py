"""The DeepInfer host tier's row copies on a CPU (the twin's path): the host copy holds the
rows in table order, a restore writes them into other rows, and each copy's seconds are
handed on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer_server.engines.deepinfer.host_rows import RowCopier, row_bytes

torch = pytest.importorskip("torch")


def test_rows_go_to_host_memory_and_back_into_other_rows() -> None:
    blocks = torch.arange(8 * 4 * 2, dtype=torch.int32).reshape(8, 4, 2)
    states = torch.arange(5 * 3, dtype=torch.int64).reshape(5, 3)
    seconds: list[tuple[bool, float]] = []
    copier = RowCopier(
        SimpleNamespace(gpu_blocks=blocks, gpu_states=states),
        lambda offloaded, spent: seconds.append((offloaded, spent)),
    )
    assert not copier.on_gpu
    assert (copier.block_bytes, copier.state_bytes) == (32, 24)
    rows = copier.offload([5, 2, 7], 3)
    assert rows.nbytes == 3 * 32 + 24
    expected_blocks = blocks[[5, 2, 7]].clone()
    expected_state = states[3].clone()
    blocks[[5, 2, 7]] = 0  # the pool reuses the rows: the host copy keeps its own
    states[3] = 0
    assert torch.equal(rows.blocks, expected_blocks) and torch.equal(rows.state, expected_state)
    copier.restore(rows, [1, 6], 4)  # a fork point within the first two blocks
    assert torch.equal(blocks[[1, 6]], expected_blocks[:2])
    assert torch.equal(states[4], expected_state)
    assert [offloaded for offloaded, _ in seconds] == [True, False]
    assert all(spent >= 0 for _, spent in seconds)


def test_rows_read_as_bytes_for_the_store_come_back_as_rows_and_are_not_counted() -> None:
    blocks = torch.arange(6 * 4 * 2, dtype=torch.int32).reshape(6, 4, 2)
    states = torch.arange(4 * 3, dtype=torch.int64).reshape(4, 3)
    seconds: list[tuple[bool, float]] = []
    copier = RowCopier(
        SimpleNamespace(gpu_blocks=blocks, gpu_states=states),
        lambda offloaded, spent: seconds.append((offloaded, spent)),
    )
    rows = copier.offload([4, 1], 2, counted=False)
    assert seconds == []  # a copy for the shared store is not the host tier's
    stored = b"".join(row_bytes(row) for row in rows.blocks)
    assert len(stored) == 2 * copier.block_bytes
    back = copier.rows_from(stored, row_bytes(rows.state))
    assert torch.equal(back.blocks, blocks[[4, 1]]) and torch.equal(back.state, states[2])
