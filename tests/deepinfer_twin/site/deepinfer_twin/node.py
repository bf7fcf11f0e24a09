"""The twin's machine: an 8-GPU SM100 node as DeepInfer's hardware discovery sees it.

`deep_cluster.hardware.nvidia` discovers GPUs from procfs, sysfs and device nodes, and their
compute capability through NVML. The twin gives it a directory holding those entries for
`DEEPINFER_TWIN_GPUS` GPUs (default 8, one B200 node) on NUMA node 0, and capability 10.0
(`DEEPINFER_TWIN_GPU_CAPABILITY` for another GPU kind), so
that DeepInfer's own CPU-budget, NUMA-binding and peak-FLOPs code runs as on a B200 node.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_REDIRECTED = ("/proc/driver/nvidia", "/dev", "/sys/bus/pci")


def gpu_count() -> int:
    return int(os.environ.get("DEEPINFER_TWIN_GPUS", "8"))


def node_root(gpus: int) -> Path:
    """A directory with the node's GPU entries (made once per GPU count)."""
    root = Path(tempfile.gettempdir()) / f"deepinfer-twin-node-{os.getuid()}-{gpus}"
    for index in range(gpus):
        bus_id = f"0000:{0x18 + index:02x}:00.0"
        (root / "proc/driver/nvidia/gpus" / bus_id).mkdir(parents=True, exist_ok=True)
        device = root / "sys/bus/pci/devices" / bus_id
        device.mkdir(parents=True, exist_ok=True)
        (device / "numa_node").write_text("0\n")
        (root / "dev").mkdir(exist_ok=True)
        (root / "dev" / f"nvidia{index}").touch()
    return root


def install() -> None:
    """Point deep_cluster's NVIDIA discovery at the twin's node."""
    from deep_cluster.hardware import nvidia

    root = node_root(gpu_count())
    real_path = nvidia._path

    def twin_path(base: Path, absolute: str) -> Path:
        if base == Path("/") and absolute.startswith(_REDIRECTED):
            return root / absolute.lstrip("/")
        return real_path(base, absolute)

    nvidia._path = twin_path
    major, _, minor = os.environ.get("DEEPINFER_TWIN_GPU_CAPABILITY", "10.0").partition(".")
    capability = (int(major), int(minor or 0))
    nvidia.compute_capability = lambda *, index=0: capability
