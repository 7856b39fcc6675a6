"""The daemon: one trio nursery composing lanes, membership, discovery, planning and stages.

`MeshNode` (node.py) is the composition; it carries out what the sans-IO `Health`
(health.py: which members to route around) and `Duty` (duty.py: what the stage is for)
decide. `NodeBackend` (generation.py) is what the OpenAI endpoint calls; `control.py` serves
meshctl over a Unix socket. See docs/operations.md.
"""
