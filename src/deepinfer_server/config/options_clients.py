"""The client-facing option groups: thinking by default, API keys and their shares, and the
stored state (Responses store, batches) clients keep in the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepinfer_server.config.option_field import float_option, int_option, option


@dataclass(frozen=True)
class ClientOptions:
    """The default thinking mode, the accepted API keys, their share of the running slots and
    the reasoning secret."""

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
    key_running_share: float = float_option(
        0.75,
        "--key-running-share",
        help="with several API keys, the share of the running slots (DP x --max-num-seqs) one "
        "key may hold at once unless its max_running says otherwise, so that another key's "
        "request starts at once; 1 lets one key fill them all (default: %(default)s)",
    )
    key_queued_share: float = float_option(
        0.5,
        "--key-queued-share",
        help="with several API keys, the share of the server's queue (--max-queued-requests) "
        "one key's requests may hold while they wait for a running slot unless its max_queued "
        "says otherwise: beyond it that key alone gets a 429 and the rest of the queue stays "
        "open to the other keys; 1 lets one key fill it (default: %(default)s)",
    )
    reasoning_secret: str | None = option(
        None,
        "--reasoning-secret",
        help="key of the Responses API's `reasoning.encrypted_content` blobs; blobs stay valid "
        "across restarts only with a fixed secret (default: $DEEPINFER_REASONING_SECRET, else a "
        "random key per start)",
        secret=True,
    )


@dataclass(frozen=True)
class StoreOptions:
    """The state directory, the Responses store and its caps, and the batches' limits."""

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
    response_store_max_mb: int = int_option(
        1024,
        "--response-store-max-mb",
        help="size cap of the whole store (responses and items as JSON) in MiB; past it the "
        "oldest responses of the API keys storing the most are deleted. Files (/v1/files) "
        "have a cap of this size too: an upload past it is refused with a 413 "
        "(default: %(default)s)",
    )
    response_store_key_max_mb: int = int_option(
        256,
        "--response-store-key-max-mb",
        help="size cap of one API key's stored responses in MiB; past it that key's oldest are "
        "deleted, never another key's; its files have a cap of this size too, and an upload "
        "past it is refused with a 413. Without --api-key every request shares one scope, "
        "capped by --response-store-max-mb only (default: %(default)s)",
    )
    response_store_max_response_mb: int = int_option(
        16,
        "--response-store-max-response-mb",
        help="the largest response stored, in MiB (its input and output items as JSON): a "
        "stored request (`store: true`) with a larger input is refused with a 400, a larger "
        "answer is reported as not stored (default: %(default)s)",
    )
    batch_max_file_mb: int = int_option(
        100,
        "--batch-max-file-mb",
        help="the largest batch input file (POST /v1/files, purpose 'batch') and Message "
        "Batches request (POST /v1/messages/batches), in MiB; larger is refused with a 413 "
        "(default: %(default)s)",
    )
    batch_max_lines: int = int_option(
        50_000,
        "--batch-max-lines",
        help="the most requests in one batch (lines of its input file), as OpenAI allows; "
        "more is refused with a 400 (default: %(default)s)",
    )
    batch_max_active: int = int_option(
        10,
        "--batch-max-active",
        help="the most batches one API key may have unfinished at once; another is refused "
        "with a 429 (default: %(default)s)",
    )
    files_key_max_count: int = int_option(
        10_000,
        "--files-key-max-count",
        help="the most files one API key may keep (uploads and batches' output and error "
        "files); an upload past it is refused with a 413 (default: %(default)s)",
    )
    batch_concurrency: int = int_option(
        8,
        "--batch-concurrency",
        help="the batch requests each API server process has in flight at once, at the "
        "lowest admission priority (default: %(default)s)",
    )
