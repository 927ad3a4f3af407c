"""Mixture-of-experts: the router (``routing.py``) and the block that runs each expert
on the tokens routed to it (``layer.py``)."""
