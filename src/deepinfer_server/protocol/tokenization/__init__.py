"""vLLM's tokenizer endpoints: `/tokenize`, `/detokenize` and `/tokenizer_info`."""
