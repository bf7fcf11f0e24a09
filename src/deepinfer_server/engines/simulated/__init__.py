"""A CPU implementation of DeepInfer 0.1.0's LLMEngine contract (deepinfer-contract.md §9)."""
