"""Speculative decoding core: proposers, lossless verification, window policy, config, telemetry.

Pure: no trio, no networking; torch only where logits are involved. See docs/speculative.md.
"""

# Names load lazily (PEP 562): `meshd.config` and the CLI import `meshd.speculative.config` without
# paying for torch, which only sampling needs.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshd.speculative.acceptance_book import AcceptanceBook
    from meshd.speculative.auto import AutoProposer
    from meshd.speculative.config import (
        MTP_STRATEGIES,
        STRATEGIES,
        SpecConfig,
        SpecConfigError,
        add_spec_arguments,
        flag_name,
        resolve_spec_config,
        spec_cli_values,
    )
    from meshd.speculative.policy import (
        DEFAULT_LINK,
        AcceptanceTracker,
        LinkModel,
        PolicyInputs,
        WindowPlan,
        choose,
    )
    from meshd.speculative.proposer import Proposer, ProposerStats
    from meshd.speculative.sampling import (
        SamplingParams,
        Verdict,
        clip_drafts,
        coupled_draft_token,
        sample_token,
        verify,
    )
    from meshd.speculative.strategies import UnknownStrategyError, make_proposer
    from meshd.speculative.telemetry import Recorder, SpecTelemetry

_WHERE = {
    "AcceptanceBook": "meshd.speculative.acceptance_book",
    "AcceptanceTracker": "meshd.speculative.policy",
    "AutoProposer": "meshd.speculative.auto",
    "DEFAULT_LINK": "meshd.speculative.policy",
    "LinkModel": "meshd.speculative.policy",
    "MTP_STRATEGIES": "meshd.speculative.config",
    "PolicyInputs": "meshd.speculative.policy",
    "Proposer": "meshd.speculative.proposer",
    "ProposerStats": "meshd.speculative.proposer",
    "Recorder": "meshd.speculative.telemetry",
    "STRATEGIES": "meshd.speculative.config",
    "SamplingParams": "meshd.speculative.sampling",
    "SpecConfig": "meshd.speculative.config",
    "SpecConfigError": "meshd.speculative.config",
    "SpecTelemetry": "meshd.speculative.telemetry",
    "UnknownStrategyError": "meshd.speculative.strategies",
    "Verdict": "meshd.speculative.sampling",
    "WindowPlan": "meshd.speculative.policy",
    "add_spec_arguments": "meshd.speculative.config",
    "choose": "meshd.speculative.policy",
    "clip_drafts": "meshd.speculative.sampling",
    "coupled_draft_token": "meshd.speculative.sampling",
    "flag_name": "meshd.speculative.config",
    "make_proposer": "meshd.speculative.strategies",
    "resolve_spec_config": "meshd.speculative.config",
    "sample_token": "meshd.speculative.sampling",
    "spec_cli_values": "meshd.speculative.config",
    "verify": "meshd.speculative.sampling",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'meshd.speculative' has no attribute {name!r}")
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
    "make_proposer",
    "resolve_spec_config",
    "sample_token",
    "spec_cli_values",
    "verify",
]
