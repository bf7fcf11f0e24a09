"""Route handlers: thin functions that parse, call, and respond."""
