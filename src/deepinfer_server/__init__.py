"""deepinfer-server: an OpenAI-compatible service for DeepSeek-V4.1-Flash on DeepInfer."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
