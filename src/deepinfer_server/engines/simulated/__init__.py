"""A CPU implementation of DeepInfer 0.1.0's LLMEngine contract (`engine.py` says what of it)."""
