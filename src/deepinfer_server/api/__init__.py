"""The HTTP API layer: Starlette app, routes, error envelopes and SSE framing (asyncio only)."""
