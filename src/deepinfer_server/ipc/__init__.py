"""Messages and sockets between the API process and the rank processes (no engine imports)."""
