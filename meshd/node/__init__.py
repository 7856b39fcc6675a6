"""The daemon: one trio nursery composing lanes, membership, discovery, planning and stages.

`MeshNode` (node.py) is the composition; `NodeBackend` (generation.py) is what the OpenAI
endpoint calls; `control.py` serves meshctl over a Unix socket. See docs/operations.md.
"""
