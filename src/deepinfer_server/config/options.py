"""ServerConfig: the server-wide command-line options, each defined once, as given.

Each field carries its flags and help text in `metadata` (`option()`); `cli.build_parser()`
generates the argument parser from these fields and from each engine backend's own options
dataclass, so an option is never spelled out twice. The options come in groups of their own
modules (`options_engine`, `options_clients`, `options_http`), composed here. `config.resolve`
turns the values as given into a `ResolvedConfig`, the only configuration the running server
reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepinfer_server.config.option_field import flag_option, float_option, int_option, option
from deepinfer_server.config.options_clients import ClientOptions, StoreOptions
from deepinfer_server.config.options_engine import PlacementOptions, SchedulingOptions
from deepinfer_server.config.options_http import HttpOptions
from deepinfer_server.disaggregation.role import DisaggregationRole

__all__ = ["ServerConfig", "option"]


# The groups' fields come first to last from the last base to the first (a dataclass collects
# its bases' fields in reverse method resolution order): this order is the --help order.
@dataclass(frozen=True)
class ServerConfig(
    HttpOptions,
    StoreOptions,
    ClientOptions,
    SchedulingOptions,
    PlacementOptions,
):
    """The server-wide options as given on the command line (engine options live with the
    engine backend): the option groups' fields, then logs, processes, disaggregation and the
    load format's."""

    disable_access_log: bool = flag_option(
        "--disable-access-log", help="do not log one line per request"
    )
    log_requests: bool = flag_option(
        "--log-requests",
        help="also log each request's body (prompts included); off by default",
    )
    log_level: str = option(
        "info",
        "--log-level",
        help="log level (default: %(default)s)",
        choices=["critical", "error", "warning", "info", "debug"],
    )
    shutdown_timeout: float = float_option(
        0.0,
        "--shutdown-timeout",
        help="on SIGTERM, seconds in-flight requests may still finish (default: %(default)s)",
    )
    api_server_count: int = int_option(
        1,
        "--api-server-count",
        help="HTTP server processes sharing the port, all driving the same DP ranks; admission, "
        "routing, /health, /metrics and shutdown stay global (default: %(default)s)",
    )
    stream_interval: int = int_option(
        1,
        "--stream-interval",
        help="tokens per streamed chunk: the first token is sent at once, then a chunk once this "
        "many tokens are waiting, and the rest at the end; more tokens per chunk cost the HTTP "
        "process less CPU per token, at the price of less smooth streaming (default: %(default)s)",
    )
    disaggregation_mode: DisaggregationRole = option(  # noqa: RUF009 - a field, as every option
        DisaggregationRole.NULL,
        "--disaggregation-mode",
        help="prefill/decode disaggregation role: 'null' runs DeepInfer's NORMAL engine "
        "(prefill and decode); 'prefill' runs its PROMPT engine (every answer is one token and "
        "a top-level kv_transfer_params naming where a decode server pulls the prompt's KV); "
        "'decode' runs its COMPLETION engine (every request must carry the kv_transfer_params "
        "of a prefill server's answer) (default: %(default)s)",
        type=DisaggregationRole.of_option,
        choices=list(DisaggregationRole),
    )
    disaggregation_transfer_backend: Literal["mooncake"] = option(
        "mooncake",
        "--disaggregation-transfer-backend",
        help="the KV-transfer library: Mooncake's Transfer Engine (the `disaggregation` extra) "
        "(default: %(default)s)",
        choices=["mooncake"],
    )
    disaggregation_bootstrap_port: int = int_option(
        8998,
        "--disaggregation-bootstrap-port",
        help="prefill server: DP rank r listens on this port + r for decode servers' release "
        "notices and health probes; 0: each rank binds a free port, reported in /server_info "
        "and the startup log (default: %(default)s)",
    )
    disaggregation_ib_device: str | None = option(
        None,
        "--disaggregation-ib-device",
        help="RDMA device(s) the transfer library uses, comma-separated (for example mlx5_0); "
        "unused by the TCP transport (default: none)",
    )
    disaggregation_transport: Literal["auto", "tcp", "rdma", "nvlink"] = option(
        "auto",
        "--disaggregation-transport",
        help="the transport Mooncake moves KV over, one for every peer: 'tcp'; 'rdma' on the "
        "--disaggregation-ib-device devices; 'nvlink' between GPUs of one node (the CUDA "
        "wheels; refused at start by a build without it, or by an engine whose KV is in host "
        "memory); 'auto': rdma when --disaggregation-ib-device is given, else nvlink when the "
        "build offers it and the KV is in GPU memory, else tcp. Both servers of a pair must "
        "run the same transport, and over nvlink the same node: a decode server refuses "
        "another pairing (default: %(default)s)",
        choices=["auto", "tcp", "rdma", "nvlink"],
    )
    disaggregation_host: str | None = option(
        None,
        "--disaggregation-host",
        help="the address decode servers reach this prefill server's transfer engine and "
        "bootstrap port at (default: --host, or this machine's address when --host is a "
        "wildcard)",
    )
    disaggregation_kv_hold_timeout: float = float_option(
        60.0,
        "--disaggregation-kv-hold-timeout",
        help="prefill server: seconds a prefilled request's KV is held for a decode server "
        "that never pulls it (default: %(default)s)",
    )
    disaggregation_transfer_timeout: float = float_option(
        30.0,
        "--disaggregation-transfer-timeout",
        help="decode server: seconds a request may wait for KV room and its pull together "
        "before it fails with a 503 (default: %(default)s)",
    )
    disaggregation_secret_file: str | None = option(
        None,
        "--disaggregation-secret-file",
        help="prefill and decode servers: a file holding the secret (at least 16 bytes) every "
        "server of the pair shares, to sign and verify KV handoffs and their releases; "
        "required with a role (default: $DEEPINFER_DISAGGREGATION_SECRET)",
    )
    get_load_format: Literal["vllm", "sglang"] = option(
        "vllm",
        "--get-load-format",
        help="the shape of GET /get_load for a router's power_of_two policy: vLLM Router's "
        '{"load": N} or the SGLang gateway\'s per-rank list (default: %(default)s; '
        "?format= overrides it per request)",
        choices=["vllm", "sglang"],
    )
