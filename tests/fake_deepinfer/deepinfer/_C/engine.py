"""RequestOutput with static getters on uint64 handles (deepinfer/_C/engine.pyi:180-281)."""

from deepinfer_server.engines.simulated.outputs import RequestOutput

__all__ = ["RequestOutput"]
