"""SpecConfig validation, precedence and CLI flags."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from meshd.speculative.config import (
    KEYS,
    SpecConfig,
    SpecConfigError,
    add_spec_arguments,
    flag_name,
    resolve_spec_config,
    spec_cli_values,
)


def test_precedence_request_over_cli_over_file_over_model_defaults() -> None:
    config = resolve_spec_config(
        model_defaults={"strategy": "mtp", "window_max_tokens": 4, "mtp_depth": 2, "ngram_max": 5},
        file={"strategy": "ngram-cache", "window_max_tokens": 6, "ngram_max": 6},
        cli={"strategy": "ngram-simple", "window_max_tokens": 10},
        request={"strategy": "disabled"},
    )
    assert config.strategy == "disabled"  # request
    assert config.window_max_tokens == 10  # CLI
    assert config.ngram_max == 6  # config file
    assert config.mtp_depth == 2  # model defaults
    assert config.ewma_alpha == SpecConfig().ewma_alpha  # built-in default
    assert resolve_spec_config({}, {}, {}, {}) == SpecConfig()


def test_out_of_range_names_key_range_and_level() -> None:
    with pytest.raises(SpecConfigError) as err:
        resolve_spec_config({}, {}, {}, {"window_max_tokens": 100})
    message = str(err.value)
    assert "window_max_tokens" in message and "0..64" in message and "request" in message
    assert (err.value.key, err.value.level) == ("window_max_tokens", "request")
    with pytest.raises(SpecConfigError, match=r"ewma_alpha.*0\.001\.\.1.*config file"):
        resolve_spec_config({}, {"ewma_alpha": 1.5}, {}, {})


def test_wrong_type_and_unknown_strategy_are_rejected() -> None:
    with pytest.raises(SpecConfigError, match=r"max_pipeline_depth must be int.*CLI"):
        resolve_spec_config({}, {}, {"max_pipeline_depth": "2"}, {})
    with pytest.raises(SpecConfigError, match=r"ngram_min must be int.*bool"):
        resolve_spec_config({}, {}, {}, {"ngram_min": True})
    with pytest.raises(SpecConfigError, match=r"strategy = 'eagle' is unknown.*mtp-cache.*model"):
        resolve_spec_config({"strategy": "eagle"}, {}, {}, {})
    # An int where a float is expected is fine and becomes a float.
    assert resolve_spec_config({}, {}, {}, {"min_speedup": 2}).min_speedup == 2.0


def test_unknown_key_is_rejected_naming_the_level() -> None:
    with pytest.raises(SpecConfigError) as err:
        resolve_spec_config({}, {"window_size": 4}, {}, {})
    assert "'window_size'" in str(err.value) and "config file" in str(err.value)
    assert err.value.level == "config file"
    with pytest.raises(SpecConfigError, match="unknown key 'eagle_heads' in request"):
        resolve_spec_config({}, {}, {}, {"eagle_heads": "x"})


def test_cross_field_checks_blame_the_level_that_set_them() -> None:
    with pytest.raises(SpecConfigError) as err:
        resolve_spec_config({"window_max_tokens": 8}, {}, {}, {"window_min_tokens": 9})
    assert "window_min_tokens" in str(err.value) and err.value.level == "request"
    with pytest.raises(SpecConfigError, match=r"ngram_min.*ngram_max.*CLI"):
        resolve_spec_config({}, {}, {"ngram_min": 5}, {})


def test_direct_construction_and_decoding_validate_too() -> None:
    with pytest.raises(SpecConfigError, match="max_pipeline_depth"):
        SpecConfig(max_pipeline_depth=0)
    raw = b'{"strategy": "ngram-simple", "window_max_tokens": 3}'
    assert msgspec.json.decode(raw, type=SpecConfig).window_max_tokens == 3
    with pytest.raises(msgspec.ValidationError, match="window_max_tokens"):
        msgspec.json.decode(b'{"window_max_tokens": 99}', type=SpecConfig)
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        msgspec.json.decode(b'{"bogus": 1}', type=SpecConfig)


def test_every_key_has_a_flag() -> None:
    assert flag_name("window_max_tokens") == "--speculative-window-max-tokens"
    assert flag_name("strategy") == "--speculative-strategy"
    assert len({flag_name(k) for k in KEYS}) == len(KEYS) == len(SpecConfig.__struct_fields__)
    with pytest.raises(SpecConfigError):
        flag_name("nope")


def test_argparse_flags_feed_the_cli_level() -> None:
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    args = parser.parse_args(
        ["--speculative-strategy", "ngram-cache", "--speculative-ewma-alpha", "0.5"]
    )
    cli = spec_cli_values(args)
    assert cli == {"strategy": "ngram-cache", "ewma_alpha": 0.5}  # only what was given
    config = resolve_spec_config({"ewma_alpha": 0.1, "ngram_max": 3}, {}, cli, {})
    assert (config.strategy, config.ewma_alpha, config.ngram_max) == ("ngram-cache", 0.5, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-strategy", "eagle"])
    help_text = parser.format_help()
    assert all(flag_name(k) in help_text for k in KEYS)
