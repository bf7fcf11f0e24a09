"""Prefill/decode disaggregation's engine-side seam, for every engine: the transfer library
(`agent`), the prefill side's bootstrap port (`bootstrap`), the KV a prefill engine holds for
decode servers (`held`) and a decode engine's pulls off the lockstep loop (`pulls`)."""
