"""The daemon's typed configuration: sources, precedence, validation and rendering.

Every key is a field of `NodeConfig` or of one of its tables (`api`, `mdns`, `membership`,
`lane`, `spec`, `planner`, `stage`, `fetch`, `bulk`, `nat`, `punch`, `emulate`); each table is the typed config of the
component it tunes. Every config struct validates one way: `__post_init__` raises a ValueError
whose message starts with the field's name, and the loader adds the table and the source. A key may be set at four levels; the later one wins:

    built-in default < TOML file (--config FILE) < environment (MESHD_<KEY>) < command line

Nested keys use `__` in the environment (`MESHD_LANE__DEAD_AFTER_S=1.0`) and `-` on the command
line (`--lane-dead-after-s 1.0`); speculative decoding keys keep their `--speculative-*` flags
(from `meshd.speculative.config`). Environment and flag values are parsed by the field's type; lists
are comma-separated. An unknown key in the file or the environment is an error naming the key
and where it was set. docs/configuration.md documents every key.
"""

from meshd.config.cli import (
    add_config_arguments,
    config_cli_values,
    config_file_path,
    load_config_from_args,
    render,
)
from meshd.config.node import (
    CONFIG_FILE_ENV,
    DEFAULT_LANE_PORT,
    SECRET_KEYS,
    ConfigError,
    NodeConfig,
)
from meshd.config.sources import (
    FLAT_ALIASES,
    KEY_TYPES,
    KEYS,
    TABLES,
    LoadedConfig,
    default_state_dir,
    env_name,
    flag_name,
    load_config,
    load_config_sources,
    parse_text,
)
from meshd.config.tables import DEFAULT_API_PORT, ApiConfig, NatDialConfig

__all__ = [
    "CONFIG_FILE_ENV",
    "DEFAULT_API_PORT",
    "DEFAULT_LANE_PORT",
    "FLAT_ALIASES",
    "KEYS",
    "KEY_TYPES",
    "SECRET_KEYS",
    "TABLES",
    "ApiConfig",
    "ConfigError",
    "LoadedConfig",
    "NatDialConfig",
    "NodeConfig",
    "add_config_arguments",
    "config_cli_values",
    "config_file_path",
    "default_state_dir",
    "env_name",
    "flag_name",
    "load_config",
    "load_config_from_args",
    "load_config_sources",
    "parse_text",
    "render",
]
