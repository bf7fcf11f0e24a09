"""The server's processes and their lifecycle: start-up, serving, shutdown, failure."""
