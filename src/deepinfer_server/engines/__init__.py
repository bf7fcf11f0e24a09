"""Engines that implement DeepInfer's LLMEngine contract; only rank processes import these."""
