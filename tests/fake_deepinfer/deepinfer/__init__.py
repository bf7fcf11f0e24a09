"""Stand-in for the `deepinfer` package (tests only)."""

import os

# The real package overwrites these at import (deepinfer/__init__.py:36-44).
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
# What the environment held when `deepinfer` was first imported: DeepInfer reads several
# variables at import, so the server must have set them before this point.
IMPORT_TIME_ENV = dict(os.environ)
