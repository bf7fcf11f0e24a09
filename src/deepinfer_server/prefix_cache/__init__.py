"""Cross-request prefix caching: the engine-independent parts.

`index.py` finds, for a new prompt, the cached sequence it can be forked from (block-prefix
hashes, then an exact token compare) and keeps the cached sequences in least-recently-used
order. It imports no engine and no torch: the DeepInfer engine's cache
(`engines/deepinfer/prefix_cache.py`) uses it, and so can the simulated engine and the router.
"""
