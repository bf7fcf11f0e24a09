"""Tests that drive real clients against a live simulated server (marker `clients`)."""
