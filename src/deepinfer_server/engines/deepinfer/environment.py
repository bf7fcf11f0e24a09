"""The environment of each rank process (computed in the API process, applied before import).

DeepInfer reads several variables once, at import or at engine construction, so every rank
gets its whole environment before anything from `deepinfer` is imported:

* `CUDA_VISIBLE_DEVICES`: exactly this rank's CP GPUs, driver GPU first, taken in order from
  the GPUs visible to the server (an existing `CUDA_VISIBLE_DEVICES` is honoured);
* `MASTER_ADDR` / `MASTER_PORT`: the rendezvous the server chose (DeepInfer uses port - 50);
* defaults for DeepInfer's own variables (below), each applied only when the user has not
  exported that variable, so anything in `DEEPINFER_*` can be enabled from the environment;
* `DEEPINFER_SO_BUILDER_CPUS`, the CPUs DeepInfer binds its grammar threads to, checked
  against the node at start-up (`so_builder_cpus`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Set
from pathlib import Path

from deepinfer_server.errors import ConfigError
from deepinfer_server.grammar.compiler import engine_env_defaults

#: Defaults the server applies unless the user exported the variable.
DEEPINFER_DEFAULTS: dict[str, str] = {
    "DEEPINFER_ACCELERATOR": "nvidia",
    # Speculative decoding (MTP draft tokens) is on in DeepInfer unless told otherwise; this
    # service ships it off: each rank is given DEEPINFER_USE_NEXTN_DECODE from
    # --speculative-tokens (`DeepInferBackend.rank_environments`). DSpark's variable draft
    # length stays off: it profiles at warm-up and is not what the option measures.
    "DEEPINFER_ENABLE_MTP_VARLEN": "0",
    # Text only: skip the 8 GiB pinned /dev/shm pool per engine that image input would use.
    "DEEPINFER_USE_MULTIMODAL_POOL": "0",
    # A byte bound on xgrammar's compiled-grammar cache (DeepInfer's default is 10 GiB).
    **engine_env_defaults(),
    "TOKENIZERS_PARALLELISM": "false",
}


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """Where the server keeps its caches when nothing says otherwise."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepinfer"


def visible_gpus(environ: Mapping[str, str], device_root: Path = Path("/")) -> list[int]:
    """Indices of the GPUs the server may use: CUDA_VISIBLE_DEVICES, or every NVIDIA device."""
    declared = environ.get("CUDA_VISIBLE_DEVICES")
    if declared is not None:
        entries = [entry.strip() for entry in declared.split(",") if entry.strip()]
        if not all(entry.isdigit() for entry in entries):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={declared!r}: DeepInfer needs integer GPU indices, not UUIDs"
            )
        return [int(entry) for entry in entries]
    proc_gpus = device_root / "proc" / "driver" / "nvidia" / "gpus"
    if proc_gpus.is_dir():
        return list(range(len(list(proc_gpus.iterdir()))))
    devices = device_root / "dev"
    if devices.is_dir():
        found = [p.name for p in devices.iterdir() if re.fullmatch(r"nvidia\d+", p.name)]
        return list(range(len(found)))
    return []


#: DeepInfer's default for DEEPINFER_SO_BUILDER_CPUS (environ.py).
DEEPINFER_SO_BUILDER_CPUS_DEFAULT = 4


def physical_gpu_count(device_root: Path = Path("/")) -> int:
    """The node's NVIDIA GPUs as DeepInfer counts them (procfs, else device nodes; not
    CUDA_VISIBLE_DEVICES): `deep_cluster.hardware.get_actual_num_gpus`."""
    proc_gpus = device_root / "proc" / "driver" / "nvidia" / "gpus"
    if proc_gpus.is_dir():
        return len([entry for entry in proc_gpus.iterdir() if entry.is_dir()])
    devices = device_root / "dev"
    if devices.is_dir():
        return len([p for p in devices.iterdir() if re.fullmatch(r"nvidia\d+", p.name)])
    return 0


def so_builder_cpus(
    driver_gpu: int,
    node_gpus: int,
    physical_cpus: int,
    allowed_cpus: Set[int],
    exported: str | None,
) -> str:
    """DEEPINFER_SO_BUILDER_CPUS for one rank, or a ConfigError that names the setting.

    DeepInfer binds its grammar threads to CPUs `driver_gpu * per_gpu` onward, `per_gpu` being
    the node's physical cores over its GPUs (`utils.get_idle_cpus`), and raises inside
    `add_request` (on every structured-output request) when the count exceeds `per_gpu`; a
    CPU outside this process's affinity (a cpuset-limited container) breaks its thread pool
    the same way. 0 leaves one grammar thread unbound. An exported value that cannot work is
    refused; otherwise DeepInfer's default of 4 is lowered until it fits.
    """
    per_gpu = physical_cpus // max(node_gpus, 1)

    def fits(count: int) -> bool:
        start = driver_gpu * per_gpu
        return count <= per_gpu and set(range(start, start + count)) <= allowed_cpus

    if exported is not None:
        try:
            count = int(exported)
        except ValueError:
            raise ConfigError(f"DEEPINFER_SO_BUILDER_CPUS={exported!r} is not a number") from None
        if count < 0 or not fits(count):
            start = driver_gpu * per_gpu
            raise ConfigError(
                f"DEEPINFER_SO_BUILDER_CPUS={count}: DeepInfer would bind the grammar threads of "
                f"GPU {driver_gpu} to CPUs {start}-{start + count - 1}, but each of the "
                f"{node_gpus} GPUs has {per_gpu} of the {physical_cpus} physical cores"
                f" and this process may run on {len(allowed_cpus)} CPUs; set at most "
                f"{_largest_fit(fits, count)} (0 leaves one grammar thread unbound)"
            )
        return str(count)
    return str(_largest_fit(fits, DEEPINFER_SO_BUILDER_CPUS_DEFAULT))


def _largest_fit(fits: Callable[[int], bool], upper: int) -> int:
    count = upper
    while count > 0 and not fits(count):
        count -= 1
    return count


def gpus_of_rank(gpus: list[int], rank: int, cp: int, ep: int) -> list[int]:
    """The CP GPUs of DP rank `rank`: its slice of the first EP visible GPUs, driver first."""
    if len(gpus) < ep:
        raise ConfigError(
            f"--ep {ep} needs {ep} GPUs but only {len(gpus)} are visible"
            + (f" (CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))})" if gpus else "")
        )
    return gpus[rank * cp : (rank + 1) * cp]


def rank_environment(
    rank: int,
    gpus: list[int],
    cp: int,
    ep: int,
    master_port: int,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Variables to set in DP rank `rank` for the DeepInfer engine."""
    env = os.environ if environ is None else environ
    result = {key: value for key, value in DEEPINFER_DEFAULTS.items() if key not in env}
    if "DEEPINFER_JIT_CACHE_DIR" not in env:
        result["DEEPINFER_JIT_CACHE_DIR"] = str(default_cache_dir(env) / "jit")
    result["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus_of_rank(gpus, rank, cp, ep)))
    result["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
    result["MASTER_PORT"] = str(master_port)
    return result
