"""Speculative decoding core: proposers, lossless verification, window policy, config, telemetry.

Pure: no trio, no networking; torch only where logits are involved. See docs/speculative.md.
"""

from meshd.spec.auto import AcceptanceBook, AutoProposer
from meshd.spec.config import (
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
from meshd.spec.proposers import UnknownStrategyError, make_proposer
from meshd.spec.sampling import (
    SamplingParams,
    Verdict,
    clip_drafts,
    keyed_uniform,
    sample_token,
    verify,
)
from meshd.spec.telemetry import Recorder, SpecTelemetry

__all__ = [
    "DEFAULT_LINK",
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
    "flag_name",
    "keyed_uniform",
    "make_proposer",
    "resolve_spec_config",
    "sample_token",
    "spec_cli_values",
    "verify",
]
