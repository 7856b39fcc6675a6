"""Command-line flags for every key, and `render` for `meshd config show`."""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from meshd.config.node import CONFIG_FILE_ENV, SECRET_KEYS, NodeConfig
from meshd.config.sources import (
    FLAT_ALIASES,
    KEY_TYPES,
    KEYS,
    TABLES,
    env_name,
    flag_name,
    load_config,
    parse_text,
)
from meshd.speculative.config import add_spec_arguments, spec_cli_values


def _dest(key: str) -> str:
    return "config__" + key.replace(".", "__")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config FILE` and one flag per key; unset flags stay absent from the namespace."""
    group = parser.add_argument_group("daemon configuration (see docs/configuration.md)")
    group.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"TOML config file (default ${CONFIG_FILE_ENV})",
    )
    for key, type_ in KEY_TYPES.items():
        if key.startswith("spec."):
            continue
        flat = [env_name(alias) for alias, k in FLAT_ALIASES.items() if k == key]
        kwargs: dict[str, Any] = {
            "dest": _dest(key),
            "default": argparse.SUPPRESS,
            "help": f"env {' or '.join([env_name(key), *flat])}",
        }
        if type_ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif str in typing.get_args(type_):  # one text or several: the flag may repeat
            kwargs["action"] = _Repeatable
            kwargs["type"] = _flag_type(type_)
            kwargs["metavar"] = "TEXT"
        else:
            kwargs["type"] = _flag_type(type_)
            kwargs["metavar"] = _metavar(type_)
        group.add_argument(flag_name(key), **kwargs)
    add_spec_arguments(parser)


class _Repeatable(argparse.Action):
    """A flag given once sets one value; given again, the values make a list."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        old = getattr(namespace, self.dest, None)
        if old is None:
            setattr(namespace, self.dest, values)
            return
        both = (old if isinstance(old, tuple) else (old,)) + (
            values if isinstance(values, tuple) else (values,)
        )
        setattr(namespace, self.dest, both)


def _flag_type(type_: Any) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse_text(text, type_)
        except ValueError as exc:
            # argparse prints this message as it is: "argument --layers: expected 2 ...".
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _metavar(type_: Any) -> str:
    origin, args = typing.get_origin(type_), typing.get_args(type_)
    if origin in (typing.Union, types.UnionType):
        return _metavar(next(a for a in args if a is not type(None)))
    if origin is tuple and Ellipsis not in args:
        return ",".join(_metavar(a) for a in args)
    if origin in (list, tuple):
        return "A,B,..."
    return {int: "INT", float: "NUMBER", str: "TEXT"}.get(type_, "VALUE")


def config_cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The keys set on the command line (after `add_config_arguments`), for `load_config`."""
    values = {key: getattr(args, _dest(key)) for key in KEYS if hasattr(args, _dest(key))}
    values.update({f"spec.{k}": v for k, v in spec_cli_values(args).items()})
    return values


def config_file_path(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """`--config FILE`, else $MESHD_CONFIG, else None (no file)."""
    return getattr(args, "config_file", None) or env.get(CONFIG_FILE_ENV) or None


def load_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> NodeConfig:
    """`load_config` for a namespace parsed with `add_config_arguments`."""
    return load_config(config_cli_values(args), env, config_file_path(args, env))


# --- rendering ------------------------------------------------------------------------------


def render(config: NodeConfig, *, as_json: bool = False) -> str:
    """The config as TOML (or JSON), secrets replaced by "<redacted>" (`meshd config show`)."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    for key in SECRET_KEYS:
        table, _, name = key.rpartition(".")
        holder = data[table] if table else data
        if holder[name]:
            holder[name] = "<redacted>"
    if as_json:
        return msgspec.json.format(msgspec.json.encode(data), indent=2).decode() + "\n"
    lines: list[str] = []
    tables: list[str] = []
    for key, value in data.items():
        if key in TABLES:
            tables.append(key)
        elif value is None:
            lines.append(f"# {key} is not set")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for table in tables:
        if data[table] is None:
            lines += ["", f"# [{table}] is not set"]
            continue
        lines += ["", f"[{table}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in data[table].items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        # JSON's string escapes are all valid in TOML basic strings.
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")
