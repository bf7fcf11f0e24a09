"""Checks that mirror DeepInfer 0.1.0's own, run in the API process before any rank starts.

Each refuses a setting the engine would reject seconds or minutes into start-up (after the
world rendezvous, or after loading weights), with a message that names the flag to change.
References are to the DeepInfer 0.1.0 source.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Mapping
from pathlib import Path

from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import ConfigError
from deepinfer_server.model.kv_block import BLOCK_SIZE

#: deepinfer/environ.py: DEFAULT_PREFILL_MAX_SUM_SEQLEN_K, the cap when the variable is unset.
DEFAULT_PREFILL_MAX_SUM_SEQLEN_K = 2**30
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def check_batch_limits(
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    environ: Mapping[str, str],
    nextn: int = 0,
) -> None:
    """The scheduler limits of deepinfer/config.py:209-228 and scheduler.hpp:112-121.

    The server never turns on chunked prefill, so a prompt must fit in one step. `nextn` is
    `--speculative-tokens`: each running sequence takes 1 + nextn tokens of a decode step.
    """
    decoding = max_num_seqs * (1 + nextn)
    if max_num_batched_tokens is None:
        batched = max(max_model_len, 4096, decoding)  # DeepInfer's default
    else:
        batched = max_num_batched_tokens
        if batched < decoding:
            raise ConfigError(
                f"--max-num-batched-tokens {batched} is smaller than --max-num-seqs "
                f"{max_num_seqs} x (1 + {nextn} draft tokens, --speculative-tokens) = "
                f"{decoding}: raise --max-num-batched-tokens, lower --max-num-seqs or "
                "--speculative-tokens"
            )
        # `TORCH_CHECK_GE(max_num_batched_tokens, block_size)` (csrc/engine/scheduler.hpp:116).
        if batched < BLOCK_SIZE:
            raise ConfigError(
                f"--max-num-batched-tokens must be at least {BLOCK_SIZE} (one KV block), "
                f"got {batched}"
            )
        if batched < max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens {batched} is smaller than --max-model-len "
                f"{max_model_len}; without chunked prefill a prompt must fit in one step: "
                f"raise --max-num-batched-tokens or lower --max-model-len"
            )
    prompt_limit = min(max_model_len, batched)
    sum_seqlen_k = _env_int(
        environ, "DEEPINFER_PREFILL_MAX_SUM_SEQLEN_K", DEFAULT_PREFILL_MAX_SUM_SEQLEN_K
    )
    if sum_seqlen_k < prompt_limit:
        raise ConfigError(
            f"DEEPINFER_PREFILL_MAX_SUM_SEQLEN_K={sum_seqlen_k} is smaller than the prompt "
            f"limit {prompt_limit}: raise it, or lower --max-model-len"
        )


def check_checkpoint(directory: Path) -> None:
    """config.json's model identity (hugging_face/config.py:237-262) and the safetensors index
    with every shard it names (hugging_face/loading.py:34-59, checked only after the weights
    start loading)."""
    config = _read_json(directory / "config.json")
    architectures = config.get("architectures")
    if architectures != [ARCHITECTURE]:
        raise ConfigError(
            f"{directory}/config.json: architectures is {architectures!r}; DeepInfer 0.1.0 "
            f"serves only [{ARCHITECTURE!r}] (a DeepSeek-V4.1 checkpoint)"
        )
    if config.get("model_type") != MODEL_TYPE:
        raise ConfigError(
            f"{directory}/config.json: model_type is {config.get('model_type')!r}, "
            f"DeepInfer 0.1.0 needs {MODEL_TYPE!r}"
        )
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        raise ConfigError(
            f"{directory} has no {INDEX_FILE}: DeepInfer loads only sharded safetensors "
            "checkpoints with an index (download the complete checkpoint)"
        )
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index_path} has no weight_map")
    missing = sorted({s for s in weight_map.values() if not (directory / str(s)).is_file()})
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise ConfigError(f"{directory} is missing shards named by {INDEX_FILE}: {shown}")


#: deepinfer/environ.py:134-143: one temperature, or one per draft position.
CONFIDENCE_TEMPERATURE = "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"


def check_speculation(nextn: int, checkpoint: Path | None, environ: Mapping[str, str]) -> None:
    """What DeepInfer needs for `--speculative-tokens` N > 0 (its MTP / DFlash drafts).

    The drafts come from the checkpoint's `num_nextn_predict_layers` DFlash layers, which
    models/deepseek.py loads only when N > 0 (after the weights, minutes into the start); a
    per-position confidence temperature list must have N entries (environ.py raises
    otherwise, at the first read inside the engine). N itself has no upper bound in 0.1.0:
    the layers and the draft length are independent (models/deepseek.py), and each draft
    costs every running sequence a token of the decode step (`check_batch_limits`).
    """
    raw = environ.get(CONFIDENCE_TEMPERATURE, "")
    if "," in raw and nextn > 0:
        entries = len(raw.split(","))
        if entries != nextn:
            raise ConfigError(
                f"{CONFIDENCE_TEMPERATURE}={raw!r} has {entries} temperatures but "
                f"--speculative-tokens is {nextn}: give one per draft position, or one for all"
            )
    if nextn == 0 or checkpoint is None:
        return
    config = _read_json(checkpoint / "config.json")
    text = config.get("text_config")
    settings = text if isinstance(text, dict) else config
    layers = settings.get("num_nextn_predict_layers", 0)
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(
            f"--speculative-tokens {nextn}: {checkpoint}/config.json has no draft layers "
            f"(num_nextn_predict_layers is {layers!r}); DeepInfer drafts with the checkpoint's "
            "DFlash (MTP) layers: use --speculative-tokens 0 with this checkpoint"
        )


def _read_json(path: Path) -> dict[str, object]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return value


#: The transformers DeepInfer 0.1.0 pins (requirements.txt) and is known to load its tokenizer
#: with: from 5.0 on, `LlamaTokenizerFast.from_pretrained` replaces the checkpoint's byte-level
#: pre-tokenizer with Metaspace, so "option 7" encodes without its space and the grammar
#: engine's token table (built from that tokenizer) allows no token that starts with a space.
DEEPINFER_TRANSFORMERS = "4.50.0"


def check_transformers(installed: str | None) -> None:
    """Refuse a transformers release with which DeepInfer's tokenizer loses its spaces."""
    if installed is None:
        return
    major = installed.split(".", 1)[0]
    if major.isdigit() and int(major) >= 5:
        raise ConfigError(
            f"DeepInfer 0.1.0 needs transformers {DEEPINFER_TRANSFORMERS} (its pinned "
            f"requirement); with transformers {installed} its tokenizer drops spaces and "
            "structured output allows no text after the first word: "
            f"pip install 'transformers=={DEEPINFER_TRANSFORMERS}'"
        )


def installed_transformers() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_preflight(
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    checkpoint: str | None,
    environ: Mapping[str, str] | None = None,
    speculative_tokens: int = 0,
) -> None:
    """Every check, in the order DeepInfer would fail them."""
    env = os.environ if environ is None else environ
    check_transformers(installed_transformers())
    check_batch_limits(max_model_len, max_num_seqs, max_num_batched_tokens, env, speculative_tokens)
    if checkpoint is not None:
        check_checkpoint(Path(checkpoint))
    check_speculation(speculative_tokens, None if checkpoint is None else Path(checkpoint), env)


def check_role(role: DisaggregationRole, prefix_caching: bool, environ: Mapping[str, str]) -> None:
    """What DeepInfer's PROMPT and COMPLETION engines run with here (`role_engines.py`)."""
    if prefix_caching:
        raise ConfigError(
            f"--disaggregation-mode {role} on --engine deepinfer runs without the prefix cache "
            "(it keeps prompts on NORMAL engines only): drop --enable-prefix-caching"
        )
    # deepinfer/environ.py's boolean rule. With it, a prompt's state row is in the kv-store
    # ring layout and must be rearranged into the inference window on the way to the decode
    # engine (worker/cache_engine.py StateBlock); the roles move the row as it is.
    extra_state = environ.get("DEEPINFER_PREFILL_STORE_EXTRA_STATE")
    if extra_state is not None and extra_state not in ("0", "", "false", "False"):
        raise ConfigError(
            f"--disaggregation-mode {role} on --engine deepinfer moves each prompt's state in "
            "the inference layout: unset DEEPINFER_PREFILL_STORE_EXTRA_STATE"
        )
