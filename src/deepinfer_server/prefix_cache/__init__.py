"""Cross-request prefix caching: the engine-independent parts.

`index.py` finds, for a new prompt, the cached sequence it can be forked from (block-prefix
hashes, then an exact token compare) and keeps the cached sequences in least-recently-used
order; `retention.py` pins the prompts requests asked to keep for a time (`cache_control`,
`prompt_cache_retention`) and puts them last in that order. They import no engine and no
torch: both engines' caches use them (and a router could use the index).
"""
