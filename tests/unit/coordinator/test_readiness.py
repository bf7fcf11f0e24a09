"""Readiness of the ranks' grammar builders: a rank whose builder still warms up after it
reported ready counts once it says its builder is warm; one that warms with its engine (no
warm-up after ready) counts at ready; the whole is ready only with every rank."""

from __future__ import annotations

from deepinfer_server.coordinator.readiness import Readiness


def test_grammar_is_ready_once_every_ranks_builder_is_warm() -> None:
    readiness = Readiness(2)
    assert not readiness.grammar_ready
    readiness.ready(0, grammar_warming=True)
    readiness.ready(1, grammar_warming=True)
    assert not readiness.grammar_ready  # both ranks serve, their builders still warm up
    readiness.grammar_warm(1)
    assert not readiness.grammar_ready
    readiness.grammar_warm(0)
    assert readiness.grammar_ready


def test_a_rank_whose_builder_warms_with_its_engine_is_warm_at_ready() -> None:
    readiness = Readiness(2)
    readiness.ready(0)
    assert not readiness.grammar_ready  # rank 1 has not reported at all
    readiness.ready(1)
    assert readiness.grammar_ready


def test_a_ranks_kv_layout_crosses_the_wire_with_its_readiness() -> None:
    from deepinfer_server.disaggregation.layout import KVLayout
    from deepinfer_server.ipc.messages import RankReady, from_rank_decoder, from_rank_encoder

    layout = KVLayout(
        engine="simulated",
        block_size=128,
        block_bytes=1024,
        state_bytes=16,
        dtype="int32",
        speculative_tokens=1,
    )
    readiness = Readiness(2)
    assert readiness.layout is None
    readiness.report(RankReady(0, 100))  # a NORMAL rank's report names none
    assert readiness.layout is None
    message = from_rank_decoder.decode(from_rank_encoder.encode(RankReady(1, 101, layout=layout)))
    assert isinstance(message, RankReady)
    readiness.report(message)
    assert readiness.layout == layout
