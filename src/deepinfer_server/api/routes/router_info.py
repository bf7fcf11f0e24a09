"""What load-aware routers read from a replica: GET /get_load and the SGLang gateway's info.

- `GET /get_load`: vLLM Router's `power_of_two` polls it and reads `{"load": N}` (requests
  running plus waiting on the whole replica). The SGLang gateway (`smg`) polls the same path
  with the same headers but reads a list with one entry per DP rank, and takes `num_tokens`
  as the load. Both routers send nothing that tells them apart, so the shape is a server
  option (`--get-load-format`), and `?format=vllm|sglang` picks one per request.
- `GET /server_info`, `/get_server_info`, `/model_info`, `/get_model_info`: what `smg` reads
  when it registers a worker (model name and path, DP size, context length, engine kind). The
  server info also says the disaggregation role and, on a prefill server, the bootstrap port
  each DP rank bound (SGLang's `disaggregation_bootstrap_port` is rank 0's): with
  `--disaggregation-bootstrap-port 0` this is where an operator or a gateway learns them;
  and the KV transport its ranks run (`disaggregation_transport`: tcp, rdma or nvlink).
"""

from __future__ import annotations

from typing import TypedDict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server import __version__
from deepinfer_server.api.state import AppState
from deepinfer_server.errors import BadRequestError

LOAD_FORMATS = ("vllm", "sglang")


async def get_load(request: Request) -> Response:
    """The replica's load in the shape the polling router reads."""
    state: AppState = request.app.state.server
    load_format = request.query_params.get("format", state.config.get_load_format)
    if load_format not in LOAD_FORMATS:
        raise BadRequestError(
            f"format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}",
            param="format",
        )
    loads = await state.rank_loads()
    if load_format == "sglang":
        return JSONResponse(
            [
                {
                    "dp_rank": load.rank,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": load.tokens,
                }
                for load in loads
            ]
        )
    return JSONResponse({"load": sum(load.running + load.waiting for load in loads)})


class ModelFields(TypedDict):
    """What SGLang's server info and model info both say of the model."""

    served_model_name: str
    model_path: str
    tokenizer_path: str
    max_model_len: int
    context_length: int


def _common(state: AppState) -> ModelFields:
    config = state.config
    return {
        "served_model_name": config.served_model_name,
        "model_path": config.model or config.served_model_name,
        "tokenizer_path": config.model or config.served_model_name,
        "max_model_len": config.max_model_len,
        "context_length": config.max_model_len,
    }


def _transport(state: AppState) -> str | None:
    """The transport the ranks move KV over, as they reported it with their readiness (None
    on a server without a prefill or decode role)."""
    layout = state.coordinator.readiness.layout
    return None if layout is None else layout.transport


async def server_info(request: Request) -> Response:
    """SGLang's server info: what one replica is and how much it runs at once."""
    state: AppState = request.app.state.server
    config = state.config
    bound = state.coordinator.bootstrap_ports
    ports = [bound[rank] for rank in sorted(bound)]
    return JSONResponse(
        {
            **_common(state),
            "dp_size": config.data_parallel_size,
            "max_running_requests": config.data_parallel_size * config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "engine": config.engine,
            "version": __version__,
            "disaggregation_mode": config.disaggregation_mode.value,
            "disaggregation_bootstrap_port": ports[0] if ports else None,
            "disaggregation_bootstrap_ports": ports,
            "disaggregation_transport": _transport(state),
        }
    )


async def model_info(request: Request) -> Response:
    """SGLang's model info: a generative model (not an embedding or reward model)."""
    state: AppState = request.app.state.server
    return JSONResponse({**_common(state), "is_generation": True, "engine": state.config.engine})
