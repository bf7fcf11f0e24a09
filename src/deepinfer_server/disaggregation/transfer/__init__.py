"""Prefill/decode disaggregation's rank side, for every engine: the transfer library
(`agent`), the prefill side's bootstrap port (`bootstrap`), the KV a prefill engine holds for
decode servers (`held`), a decode engine's pulls off the lockstep loop (`pulls`), each peer's
own transfer threads (`lanes`) and what they did (`stats`). Only engines and rank processes
import it."""
