"""The API side of prefill/decode disaggregation, and what crosses servers.

`params` is the `kv_transfer_params` wire format, `bootstrap` the bootstrap port's protocol,
`requests` a request's handoff checked against the server's role (and the prefill answer's),
`signing` the handoff's MAC and the release proof, `peers` the prefill ranks a decode
server's `/health` probes. The API process imports only this side: nothing here imports an
engine, the transfer side or a transfer library.
"""
