"""ServerConfig: the server-wide command-line options, each defined once, as given.

Each field carries its flags and help text in `metadata` (`option()`); `cli.build_parser()`
generates the argument parser from these fields and from each engine backend's own options
dataclass, so an option is never spelled out twice. `config.resolve` turns the values as given
into a `ResolvedConfig`, the only configuration the running server reads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Literal

from deepinfer_server.disaggregation.role import DisaggregationRole


def option(
    default: Any, *flags: str, help: str, secret: bool = False, **argparse_kwargs: Any
) -> Any:
    """A dataclass field that is also a command-line option (a secret one stays out of repr)."""
    metadata = {"flags": flags, "help": help, "argparse": argparse_kwargs}
    return field(default=default, metadata=metadata, repr=not secret)


@dataclass(frozen=True)
class ServerConfig:
    """The server-wide options as given on the command line (engine options live with the
    engine backend)."""

    model: str | None = option(
        None,
        "model",
        help="checkpoint directory or Hugging Face repository id (optional with "
        "--engine simulated)",
        nargs="?",
    )
    engine: str = option(
        "deepinfer",
        "--engine",
        help="inference engine (default: %(default)s); the choices come from the engine registry",
    )
    served_model_name: tuple[str, ...] = option(
        (),
        "--served-model-name",
        help="model names clients may use; the first is the one responses report (default: "
        "MODEL as given, or 'deepseek-flash' for the simulated engine without MODEL)",
        nargs="+",
    )
    host: str = option("0.0.0.0", "--host", help="HTTP listen address (default: %(default)s)")
    port: int = option(
        8000,
        "--port",
        help="HTTP port; 0 takes a free one the system picks, named in the start-up line "
        "(default: %(default)s)",
        type=int,
    )
    expert_parallel_size: int | None = option(
        None,
        "--expert-parallel-size",
        "--ep",
        help="expert-parallel size EP, the number of GPUs; DP*CP must equal EP (default: DP*CP)",
        type=int,
    )
    data_parallel_size: int | None = option(
        None,
        "--data-parallel-size",
        "--dp",
        help="data-parallel ranks, one engine process each (default: 1, or EP/CP)",
        type=int,
    )
    context_parallel_size: int | None = option(
        None,
        "--context-parallel-size",
        "--cp",
        help="context-parallel GPUs per DP rank (default: EP/DP, or 1 without --ep)",
        type=int,
    )
    max_model_len: int | None = option(
        None,
        "--max-model-len",
        help="context length in tokens, prompt plus output (default: the engine's, 32768)",
        type=int,
    )
    max_num_seqs: int = option(
        16,
        "--max-num-seqs",
        help="running sequences per DP rank (default: %(default)s)",
        type=int,
    )
    max_queued_requests: int = option(
        512,
        "--max-queued-requests",
        help="requests admitted beyond running capacity, waiting in the server's queue for a "
        "slot, before 429 (default: %(default)s)",
        type=int,
    )
    queue_timeout: float = option(
        300.0,
        "--queue-timeout",
        help="seconds an admitted request may wait for its first token (in the queue, then "
        "prefill) before it ends with 429 queue_timeout; 0 disables (default: %(default)s)",
        type=float,
    )
    clamp_max_tokens: bool = option(
        True,
        "--clamp-max-tokens",
        help="lower a max_tokens (max_completion_tokens, max_output_tokens, Anthropic's "
        "max_tokens) that does not fit after the prompt to the room --max-model-len leaves; the "
        "answer then ends with a length finish if it fills that room (agent CLIs that do not "
        "know the window ask for more than it leaves); --no-clamp-max-tokens refuses such a "
        "request with 400 context_length_exceeded instead, as OpenAI, Anthropic and vLLM do "
        "(default: on); a prompt that alone fills the window is refused either way",
        action=argparse.BooleanOptionalAction,
    )
    max_num_batched_tokens: int | None = option(
        None,
        "--max-num-batched-tokens",
        help="tokens per engine step, passed to DeepInfer (default: DeepInfer's)",
        type=int,
    )
    prefill_attempt_interval: int | None = option(
        None,
        "--prefill-attempt-interval",
        help="engine steps between the points where new prompts may be prefilled when every "
        "DP rank has one waiting (DEEPINFER_PREFILL_ATTEMPT_INTERVAL; default: that variable, "
        "else DeepInfer's 70); lower favours time to first token, higher favours throughput",
        type=int,
    )
    prefill_any_attempt_interval: int | None = option(
        None,
        "--prefill-any-attempt-interval",
        help="engine steps between the points where new prompts are prefilled when any DP rank "
        "has one waiting (DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL; default: that variable, else "
        "DeepInfer's 100)",
        type=int,
    )
    speculative_tokens: int | None = option(
        None,
        "--speculative-tokens",
        help="speculative decoding (DeepInfer's MTP): draft tokens the model proposes per "
        "sequence per decode step, verified in the same step, so one step can emit up to N+1 "
        "tokens; the answers are the same, only faster or slower. 0 turns it off "
        "(DEEPINFER_USE_NEXTN_DECODE; default: that variable, else 0 until a GPU run measures "
        "the gain)",
        type=int,
    )
    enable_prefix_caching: bool | None = option(
        None,
        "--enable-prefix-caching",
        help="reuse the KV cache and state of earlier requests' prompts for a new request that "
        "starts with the same tokens (agent turns resend the whole conversation), and route "
        "such requests to the DP rank that holds their prefix; --no-enable-prefix-caching "
        "turns it off (default: on for --engine simulated, off for --engine deepinfer until it "
        "is validated on GPUs)",
        action=argparse.BooleanOptionalAction,
    )
    prefix_cache_scope: Literal["key", "global"] = option(
        "key",
        "--prefix-cache-scope",
        help="who shares cached prompt prefixes: `key`, only requests authenticated with the "
        "same API key (another key's request never reuses, nor times, what one key sent); "
        "`global`, every request, for single-tenant deployments that want reuse across keys "
        "(a client can then learn whether another key sent a prompt from its cached_tokens "
        "and latency); either way a request's `cache_salt` keeps it apart from other salts "
        "(default: %(default)s)",
        choices=["key", "global"],
    )
    step_timeout: float = option(
        300.0,
        "--step-timeout",
        help="seconds a rank's loop may go without completing an engine step or iteration "
        "(busy or idle) before it is treated as failed (a hung engine); 0 disables "
        "(default: %(default)s)",
        type=float,
    )
    request_timeout: float = option(
        600.0,
        "--request-timeout",
        help="seconds a request may run before it is cancelled; 0 disables (default: %(default)s)",
        type=float,
    )
    startup_timeout: float = option(
        3600.0,
        "--startup-timeout",
        help="seconds every rank may take to become ready (default: %(default)s)",
        type=float,
    )
    default_thinking: Literal["enabled", "disabled"] = option(
        "enabled",
        "--default-thinking",
        help="thinking mode for Chat Completions and Responses requests that do not choose "
        "one; Messages requests think only with `thinking`, as in Anthropic's API "
        "(default: %(default)s)",
        choices=["enabled", "disabled"],
    )
    api_key: tuple[str, ...] = option(
        (),
        "--api-key",
        help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every /v1 route; "
        "repeat for several keys (default: $DEEPINFER_API_KEY, else no authentication)",
        secret=True,
        action="append",
    )
    api_key_file: str | None = option(
        None,
        "--api-key-file",
        help="file of named API keys, one per line: 'NAME KEY [max_running=N] [max_queued=N] "
        "[weight=W]' (# comments); the name labels the key's metrics and logs, the limits its "
        "admission; accepted alongside --api-key",
    )
    key_running_share: float = option(
        0.75,
        "--key-running-share",
        help="with several API keys, the share of the running slots (DP x --max-num-seqs) one "
        "key may hold at once unless its max_running says otherwise, so that another key's "
        "request starts at once; 1 lets one key fill them all (default: %(default)s)",
        type=float,
    )
    reasoning_secret: str | None = option(
        None,
        "--reasoning-secret",
        help="key of the Responses API's `reasoning.encrypted_content` blobs; blobs stay valid "
        "across restarts only with a fixed secret (default: $DEEPINFER_REASONING_SECRET, else a "
        "random key per start)",
        secret=True,
    )
    state_dir: str | None = option(
        None,
        "--state-dir",
        help="directory of the server's state: the embedded Responses store lives here "
        "(default: $DEEPINFER_STATE_DIR, else $XDG_STATE_HOME/deepinfer-server, else "
        "~/.local/state/deepinfer-server)",
    )
    response_store: str = option(
        "sqlite",
        "--response-store",
        help="where the Responses API stores responses (`store`, `previous_response_id`, "
        "`item_reference`, GET/DELETE /v1/responses/{id}): 'sqlite' (a file in --state-dir, "
        "shared by every --api-server-count process), 'sqlite:///PATH', "
        "'postgresql://USER:PASSWORD@HOST/DB' (shared by replicas; the store-postgres extra) "
        "or 'none' (stateless, as with store: false) (default: %(default)s)",
        secret=True,
    )
    response_store_ttl: str = option(
        "30d",
        "--response-store-ttl",
        help="how long stored responses are kept, in seconds or with a unit: 3600, 12h, 30d "
        "(default: %(default)s, as OpenAI keeps them)",
    )
    response_store_max_mb: int = option(
        1024,
        "--response-store-max-mb",
        help="size cap of the whole store (responses and items as JSON) in MiB; past it the "
        "oldest responses of the API keys storing the most are deleted (default: %(default)s)",
        type=int,
    )
    response_store_key_max_mb: int = option(
        256,
        "--response-store-key-max-mb",
        help="size cap of one API key's stored responses in MiB; past it that key's oldest are "
        "deleted, never another key's. Without --api-key every request shares one scope, "
        "capped by --response-store-max-mb only (default: %(default)s)",
        type=int,
    )
    response_store_max_response_mb: int = option(
        16,
        "--response-store-max-response-mb",
        help="the largest response stored, in MiB (its input and output items as JSON): a "
        "stored request (`store: true`) with a larger input is refused with a 400, a larger "
        "answer is reported as not stored (default: %(default)s)",
        type=int,
    )
    batch_max_file_mb: int = option(
        100,
        "--batch-max-file-mb",
        help="the largest batch input file (POST /v1/files, purpose 'batch') and Message "
        "Batches request (POST /v1/messages/batches), in MiB; larger is refused with a 413 "
        "(default: %(default)s)",
        type=int,
    )
    batch_max_lines: int = option(
        50_000,
        "--batch-max-lines",
        help="the most requests in one batch (lines of its input file), as OpenAI allows; "
        "more is refused with a 400 (default: %(default)s)",
        type=int,
    )
    batch_max_active: int = option(
        10,
        "--batch-max-active",
        help="the most batches one API key may have unfinished at once; another is refused "
        "with a 429 (default: %(default)s)",
        type=int,
    )
    batch_concurrency: int = option(
        8,
        "--batch-concurrency",
        help="the batch requests each API server process has in flight at once, at the "
        "lowest admission priority (default: %(default)s)",
        type=int,
    )
    allowed_origins: tuple[str, ...] = option(
        (),
        "--allowed-origins",
        help="CORS: an allowed origin, or '*'; repeatable (default: no CORS)",
        action="append",
    )
    allowed_methods: tuple[str, ...] = option(
        (),
        "--allowed-methods",
        help="CORS: an allowed method; repeatable (default with origins: '*')",
        action="append",
    )
    allowed_headers: tuple[str, ...] = option(
        (),
        "--allowed-headers",
        help="CORS: an allowed request header; repeatable (default with origins: '*')",
        action="append",
    )
    max_request_bytes: int = option(
        8 * 1024 * 1024,
        "--max-request-bytes",
        help="largest request body accepted; larger ones get 413 (default: %(default)s)",
        type=int,
    )
    max_images_per_request: int = option(
        8,
        "--max-images-per-request",
        help="most images one request may hold; more get 400 (default: %(default)s)",
        type=int,
    )
    max_image_bytes: int = option(
        10 * 1024 * 1024,
        "--max-image-bytes",
        help="largest image (encoded bytes) accepted; larger ones get 413 (default: %(default)s)",
        type=int,
    )
    allowed_media_domains: tuple[str, ...] = option(
        (),
        "--allowed-media-domains",
        help="fetch http(s) image URLs from this host: HOST (exact name, its default port 80 or "
        "443 only) or HOST:PORT; repeatable (default: none, image URLs are refused and only "
        "inline images accepted)",
        action="append",
    )
    media_fetch_timeout: float = option(
        10.0,
        "--media-fetch-timeout",
        help="seconds an image URL's whole fetch may take: connecting, headers, body and "
        "redirects (default: %(default)s)",
        type=float,
    )
    body_read_timeout: float = option(
        60.0,
        "--body-read-timeout",
        help="seconds a client may take to send its request body before 408 (default: %(default)s)",
        type=float,
    )
    header_timeout: float = option(
        20.0,
        "--header-timeout",
        help="seconds a client may take to send a request's headers, from its first byte or "
        "from connecting; the connection is then closed (default: %(default)s)",
        type=float,
    )
    write_timeout: float = option(
        30.0,
        "--write-timeout",
        help="seconds a client may take no data of a response (acknowledge nothing while data "
        "waits) before the connection is closed and its request aborted (default: %(default)s)",
        type=float,
    )
    max_queued_compiles_per_key: int = option(
        8,
        "--max-queued-compiles-per-key",
        help="structured-output grammars one API key may have compiling or waiting to compile "
        "in an API server process; beyond it 429 with Retry-After (default: %(default)s)",
        type=int,
    )
    grammar_queue_timeout: float = option(
        60.0,
        "--grammar-queue-timeout",
        help="seconds a grammar may wait for a compile worker (taken in turn between API keys) "
        "before its request gets 503 with Retry-After (default: %(default)s)",
        type=float,
    )
    grammar_warmup: bool = option(
        True,
        "--grammar-warmup",
        help="prepare the grammar compile workers and vocabulary in the background once the "
        "server listens (and each simulated rank's once it is ready), so that the first "
        "structured request does not wait for them; about 20 s of CPU per server, which "
        "--no-grammar-warmup leaves to the first structured request (default: on)",
        action=argparse.BooleanOptionalAction,
    )
    max_connections: int = option(
        1000,
        "--max-connections",
        help="open HTTP connections served; beyond it only /health and /metrics are answered "
        "(default: %(default)s)",
        type=int,
    )
    max_header_bytes: int = option(
        64 * 1024,
        "--max-header-bytes",
        help="largest request head (request line and headers) accepted; larger ones get 431 "
        "(default: %(default)s)",
        type=int,
    )
    max_header_line_bytes: int = option(
        8 * 1024,
        "--max-header-line-bytes",
        help="longest request line or header line accepted, its CRLF included, as nginx's "
        "large_client_header_buffers; a longer header gets 431, a longer request line 414 "
        "(default: %(default)s)",
        type=int,
    )
    max_receive_buffer_mb: int = option(
        256,
        "--max-receive-buffer-mb",
        help="memory in MiB the requests still being received (their headers and bodies) may "
        "hold in each API server process; past it new ones get 503 with Retry-After "
        "(default: %(default)s)",
        type=int,
    )
    disable_access_log: bool = option(
        False, "--disable-access-log", help="do not log one line per request", action="store_true"
    )
    log_requests: bool = option(
        False,
        "--log-requests",
        help="also log each request's body (prompts included); off by default",
        action="store_true",
    )
    log_level: str = option(
        "info",
        "--log-level",
        help="log level (default: %(default)s)",
        choices=["critical", "error", "warning", "info", "debug"],
    )
    shutdown_timeout: float = option(
        0.0,
        "--shutdown-timeout",
        help="on SIGTERM, seconds in-flight requests may still finish (default: %(default)s)",
        type=float,
    )
    api_server_count: int = option(
        1,
        "--api-server-count",
        help="HTTP server processes sharing the port, all driving the same DP ranks; admission, "
        "routing, /health, /metrics and shutdown stay global (default: %(default)s)",
        type=int,
    )
    stream_interval: int = option(
        1,
        "--stream-interval",
        help="tokens per streamed chunk: the first token is sent at once, then a chunk once this "
        "many tokens are waiting, and the rest at the end; more tokens per chunk cost the HTTP "
        "process less CPU per token, at the price of less smooth streaming (default: %(default)s)",
        type=int,
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
    disaggregation_bootstrap_port: int = option(
        8998,
        "--disaggregation-bootstrap-port",
        help="prefill server: DP rank r listens on this port + r for decode servers' release "
        "notices and health probes (default: %(default)s)",
        type=int,
    )
    disaggregation_ib_device: str | None = option(
        None,
        "--disaggregation-ib-device",
        help="RDMA device(s) the transfer library uses, comma-separated (for example mlx5_0); "
        "unused by the TCP transport (default: none)",
    )
    disaggregation_host: str | None = option(
        None,
        "--disaggregation-host",
        help="the address decode servers reach this prefill server's transfer engine and "
        "bootstrap port at (default: --host, or this machine's address when --host is a "
        "wildcard)",
    )
    disaggregation_kv_hold_timeout: float = option(
        60.0,
        "--disaggregation-kv-hold-timeout",
        help="prefill server: seconds a prefilled request's KV is held for a decode server "
        "that never pulls it (default: %(default)s)",
        type=float,
    )
    disaggregation_transfer_timeout: float = option(
        30.0,
        "--disaggregation-transfer-timeout",
        help="decode server: seconds a request may wait for KV room and its pull together "
        "before it fails with a 503 (default: %(default)s)",
        type=float,
    )
    get_load_format: Literal["vllm", "sglang"] = option(
        "vllm",
        "--get-load-format",
        help="the shape of GET /get_load for a router's power_of_two policy: vLLM Router's "
        '{"load": N} or the SGLang gateway\'s per-rank list (default: %(default)s; '
        "?format= overrides it per request)",
        choices=["vllm", "sglang"],
    )
