"""A route: the ordered stages (node key and layer range) that serve one session."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RouteStage:
    """One stage of a route: which node runs which layers."""

    node_key: bytes
    layer_start: int
    layer_end: int


@dataclass(frozen=True, slots=True)
class Route:
    """Stages in pipeline order, covering layers 0..num_layers exactly once."""

    model_id: str
    stages: tuple[RouteStage, ...]
    # How every stage holds the weights ("": not said; stages then do not check it).
    quantization: str = ""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a route needs at least one stage")
        expected = 0
        for stage in self.stages:
            if stage.layer_start != expected or stage.layer_end <= stage.layer_start:
                raise ValueError(
                    f"route layers must be contiguous from 0: stage {stage.layer_start}.."
                    f"{stage.layer_end} after {expected}"
                )
            expected = stage.layer_end

    @property
    def num_layers(self) -> int:
        """Layers covered (the model's layer count)."""
        return self.stages[-1].layer_end

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Node keys in pipeline order."""
        return tuple(s.node_key for s in self.stages)
