"""The DeepInfer CPU twin: DeepInfer 0.1.0's own code with only the GPU parts replaced.

`install()` runs in every process whose `PYTHONPATH` holds this directory (from its
`sitecustomize.py`), before anything imports `deepinfer`. It only adds import hooks: nothing of
DeepInfer is imported or changed until the process imports it. What the twin replaces:

- the GPU kernel packages (tilelang, deep_gemm, deep_ep, FlashMLA, ...): placeholders
  (`absent.py`); DeepInfer's own kernel modules: an empty backend (`platform.py`);
- the platform: gloo for every process group;
- CUDA events and streams: CPU stand-ins that complete at once (`cuda.py`);
- `deepinfer.worker.worker` (the GPU worker: the model forward and sampling): the twin's worker
  (`worker.py`), which drives DeepInfer's own scheduler, output pool, grammar matchers and
  post-processing exactly as the GPU worker does.
"""

from __future__ import annotations


def install() -> None:
    from deepinfer_twin import absent, hooks

    absent.install()
    hooks.install()
