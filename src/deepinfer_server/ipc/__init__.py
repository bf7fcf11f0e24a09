"""What crosses the process boundary: wire messages, token packing, the stop agreement."""
