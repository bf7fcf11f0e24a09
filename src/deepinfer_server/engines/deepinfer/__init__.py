"""DeepInfer 0.1.0 on SM100 GPUs (`--engine deepinfer`)."""
