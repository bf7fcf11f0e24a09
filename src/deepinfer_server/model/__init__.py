"""What belongs to the checkpoint: where it is, its tokenizer, its special tokens, its images,
its KV block."""
