"""Batch jobs: OpenAI's Files and Batches on one runner (`runner.py`) that answers each line
through the server's own request path, at the lowest admission priority."""
