"""The adapter's calls match DeepInfer 0.1.0's signatures (via the test stand-in, and against the
real source release when ../shared/reference is present)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import tarfile
from collections.abc import Iterator

import numpy as np
import pytest

from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.backend import EngineSpec
from deepinfer_server.engines.deepinfer.backend import DeepInferOptions
from deepinfer_server.engines.deepinfer.engine import ENGINE_ARGS_FIELDS, engine_args_kwargs
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from tests.paths import REPO, TESTS

STAND_IN = TESTS / "fake_deepinfer"
REFERENCE = REPO.parent / "shared" / "reference" / "deepinfer-0.1.0.tar.gz"


@pytest.fixture()
def stand_in() -> Iterator[None]:
    sys.path.insert(0, str(STAND_IN))
    try:
        yield
    finally:
        sys.path.remove(str(STAND_IN))
        for name in [n for n in sys.modules if n == "deepinfer" or n.startswith("deepinfer.")]:
            del sys.modules[name]


def _spec() -> EngineSpec:
    return EngineSpec(
        rank=1,
        model="/models/ckpt",
        served_model_name="flash",
        data_parallel_size=2,
        context_parallel_size=4,
        expert_parallel_size=8,
        max_model_len=32768,
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        engine_options=DeepInferOptions(gpu_memory_utilization=0.85, trust_remote_code=True),
    )


def test_engine_args_sets_every_listed_field_on_purpose(stand_in: None) -> None:
    from deepinfer.engine.arg_utils import EngineArgs

    kwargs = engine_args_kwargs(_spec())
    assert tuple(kwargs) == ENGINE_ARGS_FIELDS
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
    args = EngineArgs(**kwargs)
    assert (args.engine_rank, args.data_parallel_size, args.context_parallel_size) == (1, 2, 4)
    assert args.max_model_len == 32768  # never DeepInfer's 4096 default
    assert args.tokenizer == "/models/ckpt"
    assert args.engine_type.name == "NORMAL" and not args.stop_preempted_request


@pytest.mark.parametrize(
    ("mode", "engine_type", "stop_preempted"),
    [("prefill", "PROMPT", False), ("decode", "COMPLETION", True)],
)
def test_a_role_is_deepinfers_engine_type(
    stand_in: None, mode: str, engine_type: str, stop_preempted: bool
) -> None:
    from deepinfer.engine.arg_utils import EngineArgs

    spec = dataclasses.replace(
        _spec(), context_parallel_size=1, disaggregation_mode=DisaggregationRole(mode)
    )
    args = EngineArgs(**engine_args_kwargs(spec))
    assert args.engine_type.name == engine_type
    # DeepInfer's scheduler refuses a COMPLETION engine that would recompute a preempted
    # request (it has no prefill to recompute with).
    assert args.stop_preempted_request is stop_preempted


def test_driver_add_request_call_binds_to_the_signature(stand_in: None) -> None:
    from deepinfer.engine.llm_engine import LLMEngine

    signature = inspect.signature(LLMEngine.add_request)
    # LLMEngineDriver.add calls add_request("0", request_id, params, prompt).
    signature.bind(None, "0", "r1", {}, np.zeros(1, dtype=np.int32))
    sampling_keys = {"max_tokens", "temperature", "top_p", "ignore_eos", "seq_seed"}
    assert sampling_keys <= set(inspect.signature(SamplingParams).parameters)


def _reference_source(member: str) -> ast.Module:
    if not REFERENCE.is_file():
        pytest.skip(f"the DeepInfer source release is not at {REFERENCE}")
    with tarfile.open(REFERENCE) as archive:
        extracted = archive.extractfile(f"deepinfer-0.1.0/{member}")
        assert extracted is not None
        return ast.parse(extracted.read())


def _dataclass_fields(module: ast.Module, name: str) -> list[tuple[str, str]]:
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)
    return [
        (node.target.id, ast.unparse(node.value) if node.value else "")
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]


def _init_parameters(module: ast.Module, name: str, method: str) -> list[str]:
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return [a.arg for a in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]]


def test_stand_in_engine_args_match_the_source_release() -> None:
    real = _dataclass_fields(_reference_source("deepinfer/engine/arg_utils.py"), "EngineArgs")
    stand_in_module = ast.parse((STAND_IN / "deepinfer/engine/arg_utils.py").read_text())
    assert _dataclass_fields(stand_in_module, "EngineArgs") == real


def test_stand_in_add_request_matches_the_source_release() -> None:
    real = _init_parameters(
        _reference_source("deepinfer/engine/llm_engine.py"), "LLMEngine", "add_request"
    )
    stand_in_module = ast.parse((STAND_IN / "deepinfer/engine/llm_engine.py").read_text())
    assert _init_parameters(stand_in_module, "LLMEngine", "add_request") == real


def test_simulated_sampling_params_match_the_source_release() -> None:
    real = _init_parameters(
        _reference_source("deepinfer/sampling_params.py"), "SamplingParams", "__init__"
    )
    assert ["self", *inspect.signature(SamplingParams).parameters] == real
