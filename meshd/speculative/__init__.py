"""Speculative decoding core: proposers, lossless verification, window policy, config, telemetry.

Pure: no trio, no networking; torch only where logits are involved. See docs/speculative.md.

Import the submodules directly (`meshd.speculative.config`, ...): this package imports
nothing itself, so `meshd.config` and the CLI read the speculative config without torch.
"""
