"""The adapter's calls match DeepInfer 0.1.0's signatures: run against DeepInfer's own code (the
CPU twin), and read against the source release when ../shared/reference is present."""

from __future__ import annotations

import ast
import inspect
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from deepinfer_server.engines.deepinfer.add_request import add_request_args
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin.runner import run_in_twin
from tests.paths import REPO

REFERENCE = REPO.parent / "shared" / "reference" / "deepinfer-0.1.0.tar.gz"

#: Run in a twin process (nothing built): one rank's spec, as the server's rank would see it.
SPEC = """
import dataclasses, inspect, types
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.backend import EngineSpec
from deepinfer_server.engines.deepinfer.backend import DeepInferOptions
from deepinfer_server.engines.deepinfer.engine import ENGINE_ARGS_FIELDS, engine_args_kwargs

ENGINE = types.SimpleNamespace(close=lambda: None)
SPEC = EngineSpec(
    rank=1, model="/models/ckpt", served_model_name="flash", data_parallel_size=2,
    context_parallel_size=4, expert_parallel_size=8, max_model_len=32768, max_num_seqs=16,
    max_num_batched_tokens=8192,
    engine_options=DeepInferOptions(gpu_memory_utilization=0.85, trust_remote_code=True),
)
"""


def _on_the_twin(tmp_path: Path, body: str) -> Any:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    return run_in_twin(checkpoint, SPEC + textwrap.dedent(body), engine={"build": False})


@pytest.mark.e2e  # a twin process
@pytest.mark.deepinfer_twin
def test_engine_args_sets_every_listed_field_on_purpose(tmp_path: Path) -> None:
    result = _on_the_twin(
        tmp_path,
        """
        kwargs = engine_args_kwargs(SPEC)
        args = EngineArgs(**kwargs)
        RESULT = {
            "kwargs": list(kwargs), "listed": list(ENGINE_ARGS_FIELDS),
            "fields": [f.name for f in dataclasses.fields(EngineArgs)],
            "args": {name: getattr(args, name) for name in (
                "engine_rank", "data_parallel_size", "context_parallel_size", "max_model_len",
                "tokenizer", "stop_preempted_request")},
            "engine_type": args.engine_type.name,
        }
        """,
    )
    assert result["kwargs"] == result["listed"]
    assert set(result["kwargs"]) <= set(result["fields"])
    args = result["args"]
    assert (args["engine_rank"], args["data_parallel_size"]) == (1, 2)
    assert args["context_parallel_size"] == 4
    assert args["max_model_len"] == 32768  # never DeepInfer's 4096 default
    assert args["tokenizer"] == "/models/ckpt"
    assert result["engine_type"] == "NORMAL" and not args["stop_preempted_request"]


@pytest.mark.e2e  # a twin process
@pytest.mark.deepinfer_twin
def test_a_role_is_deepinfers_engine_type(tmp_path: Path) -> None:
    result = _on_the_twin(
        tmp_path,
        """
        RESULT = {}
        for mode in ("prefill", "decode"):
            role = DisaggregationRole(mode)
            spec = dataclasses.replace(SPEC, context_parallel_size=1, disaggregation_mode=role)
            args = EngineArgs(**engine_args_kwargs(spec))
            RESULT[mode] = [args.engine_type.name, args.stop_preempted_request]
        """,
    )
    # DeepInfer's scheduler refuses a COMPLETION engine that would recompute a preempted
    # request (it has no prefill to recompute with).
    assert result == {"prefill": ["PROMPT", False], "decode": ["COMPLETION", True]}


@pytest.mark.e2e  # a twin process
@pytest.mark.deepinfer_twin
def test_driver_add_request_call_binds_to_the_signature(tmp_path: Path) -> None:
    result = _on_the_twin(
        tmp_path,
        """
        signature = inspect.signature(LLMEngine.add_request)
        # LLMEngineDriver.add calls add_request("0", request_id, params, prompt).
        signature.bind(None, "0", "r1", {}, np.zeros(1, dtype=np.int32))
        RESULT = "bound"
        """,
    )
    assert result == "bound"


def test_the_simulated_sampling_params_take_what_the_driver_passes() -> None:
    sampling_keys = {"max_tokens", "temperature", "top_p", "ignore_eos", "seq_seed"}
    assert sampling_keys <= set(inspect.signature(SamplingParams).parameters)


def _reference_source(member: str) -> ast.Module:
    if not REFERENCE.is_file():
        pytest.skip(f"the DeepInfer source release is not at {REFERENCE}")
    with tarfile.open(REFERENCE) as archive:
        extracted = archive.extractfile(f"deepinfer-0.1.0/{member}")
        assert extracted is not None
        return ast.parse(extracted.read())


def _init_parameters(module: ast.Module, name: str, method: str) -> list[str]:
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return [a.arg for a in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]]


def test_simulated_sampling_params_match_the_source_release() -> None:
    real = _init_parameters(
        _reference_source("deepinfer/sampling_params.py"), "SamplingParams", "__init__"
    )
    assert ["self", *inspect.signature(SamplingParams).parameters] == real


def test_the_subclasses_pass_on_every_add_request_argument_of_the_source_release() -> None:
    """The prefix cache's and the roles' `add_request` hand DeepInfer's arguments on by position
    (`add_request_args`): its parameters and defaults must be the release's, in its order."""
    module = _reference_source("deepinfer/engine/llm_engine.py")
    assert _init_parameters(module, "LLMEngine", "add_request") == [
        "self",
        *inspect.signature(add_request_args).parameters,
    ]
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_request")
    defaults = [ast.literal_eval(default) for default in func.args.defaults]
    ours = [
        parameter.default
        for parameter in inspect.signature(add_request_args).parameters.values()
        if parameter.default is not inspect.Parameter.empty
    ]
    assert ours == defaults
