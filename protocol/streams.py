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
# Model artifacts: manifests and tensor chunks, fetched by nodes started with `mesh:ID`
# (`protocol/artifacts.py`).
ARTIFACT_STREAM = 3
# API requests relayed to a node that serves the request's model (`protocol/api_relay.py`).
API_STREAM = 4

# Bulk streams yield to every other stream on a lane (`protocol.transport`): their bytes go
# only where nothing else waits, and never fill the congestion window.
BULK_STREAMS = frozenset({ARTIFACT_STREAM})

__all__ = [
    "API_STREAM",
    "ARTIFACT_STREAM",
    "BULK_STREAMS",
    "GOSSIP_STREAM",
    "NAT_STREAM",
    "PIPELINE_STREAM",
]
