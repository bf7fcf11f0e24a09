"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`)."""
