"""The rank process: one per DP rank, owning one engine and driving it in lockstep rounds."""
