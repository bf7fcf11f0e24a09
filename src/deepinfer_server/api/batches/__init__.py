"""Batch jobs as HTTP shows them: OpenAI's Files and Batches objects and Anthropic's Message
Batches (the lines are answered by `services/batch_runner.py`, through the server's own request
path, at the lowest admission priority)."""
