"""The engine registry: every `--engine` choice and its backend declarations.

Adding an engine is one new backend module (an `EngineBackend` subclass whose `builder` names
the function that constructs it inside a rank process) plus one line here.
"""

from __future__ import annotations

from deepinfer_server.engines.backend import EngineBackend
from deepinfer_server.engines.deepinfer.backend import DeepInferBackend
from deepinfer_server.engines.simulated.backend import SimulatedBackend
from deepinfer_server.errors import ConfigError

BACKENDS: dict[str, EngineBackend] = {
    backend.name: backend for backend in (DeepInferBackend(), SimulatedBackend())
}


def get_backend(name: str) -> EngineBackend:
    """The backend registered as `name`; ConfigError names the choices otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        choices = ", ".join(sorted(BACKENDS))
        raise ConfigError(f"--engine {name!r} is not one of: {choices}") from None
