"""Legacy Completions (`POST /v1/completions`), as vLLM serves it."""
