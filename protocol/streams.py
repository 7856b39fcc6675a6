"""Lane stream ids: which stream carries which protocol's messages.

A lane multiplexes streams (`protocol/stream.py`); the receiver picks the decoder by stream id,
so both ends must agree on these numbers. They are wire format: never renumber one.
"""

# Membership gossip (`protocol/gossip.py`).
GOSSIP_STREAM = 0
# Pipeline messages: windows, hidden states, replies (`protocol/messages.py`).
PIPELINE_STREAM = 1
# NAT traversal: introduction requests, introductions and refusals (`protocol/punch.py`).
NAT_STREAM = 2
# API requests relayed to a node that serves the request's model (`protocol/api_relay.py`).
API_STREAM = 4

__all__ = ["API_STREAM", "GOSSIP_STREAM", "NAT_STREAM", "PIPELINE_STREAM"]
