"""Prefill/decode disaggregation, in one package.

- `handoff`: the API side and the wire: the `kv_transfer_params` handoff, the bootstrap
  port's protocol, a request's handoff checked against the role, the prefill peers.
- `transfer`: the rank side: the transfer library (`agent`), the prefill side's bootstrap
  port and holds, a decode engine's pulls and their statistics. Only engines and rank
  processes import it.

The engines' own hooks stay beside each engine (`engines/simulated/disaggregation.py`,
`engines/deepinfer/prompt_role.py` and `completion_role.py`).
"""
