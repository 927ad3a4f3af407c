"""KV transfer between engines for prefill/decode disaggregation.

A prefill engine computes a prompt's KV blocks, holds them under a lease
(``leases.py``) and serves them through its side channel (``side_channel.py``); a
decode engine reads the blocks its prefix cache lacks through a transport
(``transport.py``) and decodes. ``params.py`` is the request-level contract
(vLLM's ``kv_transfer_params``)."""
