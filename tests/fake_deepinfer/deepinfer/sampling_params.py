"""SamplingParams: the server's simulated copy has the same signature and validation."""

from deepinfer_server.engines.simulated.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
