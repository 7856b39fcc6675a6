"""Speculative decoding core: proposers, lossless verification, window policy, config, telemetry.

Pure: no trio, no networking; torch only where logits are involved. See docs/speculative.md.
"""

# Names load lazily (PEP 562): `meshd.config` and the CLI import `meshd.spec.config` without
# paying for torch, which only sampling needs.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshd.spec.auto import AcceptanceBook, AutoProposer
    from meshd.spec.config import (
        MTP_STRATEGIES,
        STRATEGIES,
        SpecConfig,
        SpecConfigError,
        add_spec_arguments,
        flag_name,
        resolve_spec_config,
        spec_cli_values,
    )
    from meshd.spec.policy import (
        DEFAULT_LINK,
        AcceptanceTracker,
        LinkModel,
        PolicyInputs,
        WindowPlan,
        choose,
    )
    from meshd.spec.proposer import Proposer, ProposerStats
    from meshd.spec.sampling import (
        SamplingParams,
        Verdict,
        clip_drafts,
        coupled_draft_token,
        keyed_uniform,
        sample_token,
        verify,
    )
    from meshd.spec.strategies import UnknownStrategyError, make_proposer
    from meshd.spec.telemetry import Recorder, SpecTelemetry

_WHERE = {
    "AcceptanceBook": "meshd.spec.auto",
    "AcceptanceTracker": "meshd.spec.policy",
    "AutoProposer": "meshd.spec.auto",
    "DEFAULT_LINK": "meshd.spec.policy",
    "LinkModel": "meshd.spec.policy",
    "MTP_STRATEGIES": "meshd.spec.config",
    "PolicyInputs": "meshd.spec.policy",
    "Proposer": "meshd.spec.proposer",
    "ProposerStats": "meshd.spec.proposer",
    "Recorder": "meshd.spec.telemetry",
    "STRATEGIES": "meshd.spec.config",
    "SamplingParams": "meshd.spec.sampling",
    "SpecConfig": "meshd.spec.config",
    "SpecConfigError": "meshd.spec.config",
    "SpecTelemetry": "meshd.spec.telemetry",
    "UnknownStrategyError": "meshd.spec.strategies",
    "Verdict": "meshd.spec.sampling",
    "WindowPlan": "meshd.spec.policy",
    "add_spec_arguments": "meshd.spec.config",
    "choose": "meshd.spec.policy",
    "clip_drafts": "meshd.spec.sampling",
    "coupled_draft_token": "meshd.spec.sampling",
    "flag_name": "meshd.spec.config",
    "keyed_uniform": "meshd.spec.sampling",
    "make_proposer": "meshd.spec.strategies",
    "resolve_spec_config": "meshd.spec.config",
    "sample_token": "meshd.spec.sampling",
    "spec_cli_values": "meshd.spec.config",
    "verify": "meshd.spec.sampling",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'meshd.spec' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT_LINK",
    "MTP_STRATEGIES",
    "STRATEGIES",
    "AcceptanceBook",
    "AcceptanceTracker",
    "AutoProposer",
    "LinkModel",
    "PolicyInputs",
    "Proposer",
    "ProposerStats",
    "Recorder",
    "SamplingParams",
    "SpecConfig",
    "SpecConfigError",
    "SpecTelemetry",
    "UnknownStrategyError",
    "Verdict",
    "WindowPlan",
    "add_spec_arguments",
    "choose",
    "clip_drafts",
    "coupled_draft_token",
    "flag_name",
    "keyed_uniform",
    "make_proposer",
    "resolve_spec_config",
    "sample_token",
    "spec_cli_values",
    "verify",
]
