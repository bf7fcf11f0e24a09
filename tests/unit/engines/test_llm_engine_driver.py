"""LLMEngineDriver driving the simulated engine: the code path that will drive DeepInfer."""

from __future__ import annotations

from functools import cache

from tokenizers import Tokenizer

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver, finish_of
from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.errors import ErrorKind
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, Finish, Images, SamplingOptions
from deepinfer_server.model.tokenizer import embedded_tokenizer_json


@cache
def _tokenizer_json() -> str:
    return embedded_tokenizer_json()


def make_adapter(**overrides: object) -> LLMEngineDriver:
    args = SimEngineArgs(
        tokenizer_json=_tokenizer_json(), lockstep=new_lockstep_group(1, 5.0), ttft_ms=0, itl_ms=0
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return LLMEngineDriver(LLMEngine.from_engine_args(args), RequestOutput)


def add(adapter: LLMEngineDriver, request_id: str, ids: list[int], **sampling: object) -> object:
    options = SamplingOptions(**{"max_tokens": 50, **sampling})  # type: ignore[arg-type]
    return adapter.add(AddRequest(request_id, pack_token_ids(ids), options))


PROMPT = [0, 128803, 19923, 128804, 128822]  # BOS <｜User｜> "Hello" <｜Assistant｜> </think>


def drain(adapter: LLMEngineDriver) -> dict[str, tuple[list[int], Finish | None]]:
    results: dict[str, tuple[list[int], Finish | None]] = {}
    for _ in range(1000):
        unfinished, outputs = adapter.iterate()
        for output in outputs:
            tokens, _ = results.get(output.request_id, ([], None))
            results[output.request_id] = (tokens + output.tokens.token_ids, output.finish)
        if not unfinished and not outputs:
            return results
    raise AssertionError("the engine never went idle")


def test_eos_of_a_stop_finish_is_hidden() -> None:
    adapter = make_adapter()
    assert add(adapter, "r1", PROMPT) is None
    tokens, reason = drain(adapter)["r1"]
    assert reason is Finish.STOP
    assert tokens == [19923]  # "Hello", without EOS


def test_several_tokens_per_step_are_batched_per_request() -> None:
    adapter = make_adapter(tokens_per_step=3)
    add(adapter, "r1", PROMPT, max_tokens=7, ignore_eos=True)
    sizes = []
    while True:
        unfinished, outputs = adapter.iterate()
        sizes += [len(o.tokens) for o in outputs]
        if not unfinished and not outputs:
            break
    assert sum(sizes) == 7 and max(sizes) == 3


def test_outputs_after_an_abort_are_discarded() -> None:
    adapter = make_adapter()
    add(adapter, "r1", PROMPT, ignore_eos=True)
    adapter.iterate()
    adapter.iterate()
    adapter.abort(["r1"])
    assert adapter.num_live == 0
    assert drain(adapter) == {}


def test_waiting_abort_output_is_not_forwarded() -> None:
    adapter = make_adapter(ttft_ms=60_000)
    add(adapter, "r1", PROMPT)
    adapter.abort(["r1"])
    unfinished, outputs = adapter.iterate()
    assert not unfinished and outputs == []


def test_engine_rejections_become_messages() -> None:
    adapter = make_adapter()
    rejected = add(adapter, "bad", [0, 10**7])
    assert rejected is not None and rejected.kind is ErrorKind.ENGINE_REJECTED  # type: ignore[attr-defined]
    rejected = add(adapter, "empty", [])
    assert rejected is not None and "empty" in rejected.message  # type: ignore[attr-defined]
    assert adapter.num_live == 0


def test_prompt_length_exceeded_is_forwarded_without_a_token() -> None:
    adapter = make_adapter(max_model_len=3)
    add(adapter, "r1", PROMPT)
    assert drain(adapter) == {"r1": ([], Finish.PROMPT_TOO_LONG)}


def test_deepinfer_finish_strings_map_to_outcomes() -> None:
    assert finish_of("stop") is Finish.STOP
    assert finish_of("length") is Finish.LENGTH
    assert finish_of("insufficient_system_resource") is Finish.OUT_OF_RESOURCES
    assert finish_of("xgrammar runtime errors or timeout") is Finish.GRAMMAR_FAILED
    assert finish_of("ve_error") is Finish.ENGINE_ERROR


def test_images_reach_the_engine_as_multi_modal_data() -> None:
    adapter = make_adapter()
    images = Images(sizes=[(630, 476)], data=[b"RIFF-image-bytes"])
    options = SamplingOptions(max_tokens=50)
    adapter.add(AddRequest("r1", pack_token_ids(PROMPT), options, images))
    tokens, reason = drain(adapter)["r1"]
    assert reason is Finish.STOP
    # The simulated engine describes what it was given: size and digest of the bytes.
    text = Tokenizer.from_str(_tokenizer_json()).decode(tokens)
    assert text.startswith("[image 1: 630x476 sha256:")


def test_eos_under_ignore_eos_counts_but_is_never_rendered() -> None:
    adapter = make_adapter()
    add(adapter, "r1", PROMPT, max_tokens=5, ignore_eos=True)
    rendered: list[int] = []
    hidden = 0
    finish = None
    while finish is None:
        _, outputs = adapter.iterate()
        for output in outputs:
            rendered += output.tokens.token_ids
            hidden += output.tokens.hidden_tokens
            finish = output.finish or finish
    # "Hello" EOS "Hello" EOS "Hello": the two EOS count toward max_tokens, unrendered.
    assert finish is Finish.LENGTH
    assert rendered == [19923, 19923, 19923]
    assert hidden == 2
