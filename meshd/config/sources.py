"""Where config comes from: defaults < TOML file < environment < command line.

Each source becomes a "level": dotted key → (value, where it was set). Levels are merged in
precedence order, and the merged values are converted into `NodeConfig` in one place, so
every error can name the key and the source that set it.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from meshd.config.node import CONFIG_FILE_ENV, ENV_PREFIX, ConfigError, NodeConfig
from meshd.mesh.jointoken import JoinTokenError, parse_join_token
from meshd.model.process_env import PROCESS_ENV
from meshd.speculative.config import flag_name as spec_flag_name


def _tables() -> dict[str, type[msgspec.Struct]]:
    """NodeConfig's fields that are tables (Structs), by name: `[mdns]`, `[planner]`, ..."""
    tables: dict[str, type[msgspec.Struct]] = {}
    for f in msgspec.structs.fields(NodeConfig):
        types_ = [f.type, *typing.get_args(f.type)]
        struct = next(
            (t for t in types_ if isinstance(t, type) and issubclass(t, msgspec.Struct)), None
        )
        if struct is not None:
            tables[f.name] = struct
    return tables


TABLES: dict[str, type[msgspec.Struct]] = _tables()


def _key_types() -> dict[str, Any]:
    types_: dict[str, Any] = {}
    for f in msgspec.structs.fields(NodeConfig):
        if f.name in TABLES:
            for g in msgspec.structs.fields(TABLES[f.name]):
                types_[f"{f.name}.{g.name}"] = g.type
        else:
            types_[f.name] = f.type
    return types_


KEY_TYPES: dict[str, Any] = _key_types()
KEYS: tuple[str, ...] = tuple(KEY_TYPES)
# The `[api]` table's keys are also accepted flat at the top level (`api_port`, env
# MESHD_API_PORT), the spelling of the configs written before the table: flat → dotted.
FLAT_ALIASES: dict[str, str] = {
    "api_" + k.removeprefix("api."): k for k in KEYS if k.startswith("api.")
}


def env_name(key: str) -> str:
    """The environment variable of a key: `lane.dead_after_s` → `MESHD_LANE__DEAD_AFTER_S`."""
    return ENV_PREFIX + key.upper().replace(".", "__")


def flag_name(key: str) -> str:
    """The command-line flag of a key: `lane.dead_after_s` → `--lane-dead-after-s`."""
    if key.startswith("spec.") and key in KEY_TYPES:
        return spec_flag_name(key.removeprefix("spec."))
    return "--" + key.replace(".", "-").replace("_", "-")


def parse_text(text: str, type_: Any) -> Any:
    """Parse an environment or flag value by the field's type; lists are comma-separated.

    Raises ValueError saying what was expected.
    """
    origin, args = typing.get_origin(type_), typing.get_args(type_)
    if origin in (typing.Union, types.UnionType) and str in args:
        # One text or several (`model`): a comma separates them.
        return tuple(s.strip() for s in text.split(",")) if "," in text else text
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("", "none"):
            return None
        (inner,) = (a for a in args if a is not type(None))
        return parse_text(text, inner)
    if type_ is bool:
        word = text.strip().lower()
        if word not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"expected true or false, got {text!r}")
        return word in ("true", "1", "yes", "on")
    if type_ in (int, float):
        try:
            return type_(text.strip())
        except ValueError:
            raise ValueError(
                f"expected {'an integer' if type_ is int else 'a number'}, got {text!r}"
            ) from None
    if type_ is str:
        return text
    if origin in (list, tuple):
        items = [s.strip() for s in text.split(",")] if text.strip() else []
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_text(s, args[0]) for s in items)
        if origin is tuple:
            if len(items) != len(args):
                raise ValueError(f"expected {len(args)} comma-separated values, got {text!r}")
            return tuple(parse_text(s, t) for s, t in zip(items, args, strict=True))
        return [parse_text(s, args[0]) for s in items]
    raise TypeError(f"no text form for {type_!r}")


Level = dict[str, tuple[Any, str, str]]  # dotted key -> (value, source, spelling there)
_T = typing.TypeVar("_T")


def _file_level(path: str | os.PathLike[str]) -> Level:
    source = f"config file {os.fspath(path)}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {os.fspath(path)}: {exc.strerror}", key=""
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}", key="") from None
    level: Level = {}
    for key, value in data.items():
        if key in TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a table ([{key}])", key=key, source=source)
            for sub, sub_value in value.items():
                _put(level, f"{key}.{sub}", sub_value, source, spelled=f"[{key}] {sub}")
        else:
            _put(level, key, value, source, spelled=key)
    return level


def _put(level: Level, key: str, value: Any, source: str, *, spelled: str) -> None:
    """Set `key` (dotted, or a flat alias) in one level; `spelled` is how the source wrote it.

    One level may spell a key one way only: `api_port` and `[api] port` together are an error.
    """
    canonical = FLAT_ALIASES.get(key, key)
    _known(canonical, source)
    if canonical in level:
        raise ConfigError(
            f"{canonical} is set twice in one place, as {level[canonical][2]} and as {spelled}: "
            f"keep one",
            key=canonical,
            source=source,
        )
    level[canonical] = (value, source, spelled)


def _env_level(env: Mapping[str, str]) -> Level:
    level: Level = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or name in (CONFIG_FILE_ENV, *PROCESS_ENV):
            continue
        source = f"env {name}"
        key = name.removeprefix(ENV_PREFIX).lower().replace("__", ".")
        if key in TABLES:
            raise ConfigError(
                f"{key} is a table: set its keys as {name}__<KEY>", key=key, source=source
            )
        canonical = FLAT_ALIASES.get(key, key)
        _known(canonical, source)
        try:
            value = parse_text(text, KEY_TYPES[canonical])
        except ValueError as exc:
            raise ConfigError(f"{canonical}: {exc}", key=canonical, source=source) from None
        _put(level, key, value, source, spelled=name)
    return level


def _flag_level(values: Mapping[str, Any]) -> Level:
    level: Level = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and key in TABLES:
            for sub, sub_value in value.items():
                _put_flag(level, f"{key}.{sub}", sub_value)
        else:
            _put_flag(level, key, value)
    return level


def _put_flag(level: Level, key: str, value: Any) -> None:
    canonical = FLAT_ALIASES.get(key, key)
    source = f"flag {flag_name(canonical)}"
    _put(level, key, value, source, spelled=key)


def _known(key: str, source: str) -> None:
    if key in KEY_TYPES:
        return
    table, _, name = key.rpartition(".")
    if table and table not in TABLES:
        raise ConfigError(
            f"unknown key {key!r}: there is no table [{table}]; tables: {', '.join(TABLES)}",
            key=key,
            source=source,
        )
    known = [k.rpartition(".")[2] for k in KEYS if k.rpartition(".")[0] == table]
    if not table:
        known += FLAT_ALIASES
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = f" in [{table}]" if table else ""
    raise ConfigError(
        f"unknown key {key!r}; {hint}known keys{where}: {', '.join(known)}",
        key=key,
        source=source,
    )


@dataclass(frozen=True)
class LoadedConfig:
    """A config and where each key came from (keys absent from `origins` are defaults)."""

    config: NodeConfig
    origins: dict[str, str]
    values: dict[str, Any]


def load_config(
    argv_values: Mapping[str, Any],
    env: Mapping[str, str],
    file: str | os.PathLike[str] | None,
    *,
    now_unix: float | None = None,
) -> NodeConfig:
    """Merge defaults < TOML `file` < `env` (MESHD_*) < `argv_values` into a NodeConfig.

    `argv_values` holds only keys set on the command line, dotted (`lane.dead_after_s`) or
    nested; `config_cli_values(args)` builds it from argparse. A join token is checked for
    expiry against `now_unix` (default: the wall clock). Raises ConfigError naming the key
    and its source.
    """
    return load_config_sources(argv_values, env, file, now_unix=now_unix).config


def load_config_sources(
    argv_values: Mapping[str, Any],
    env: Mapping[str, str],
    file: str | os.PathLike[str] | None,
    *,
    now_unix: float | None = None,
) -> LoadedConfig:
    """Like `load_config`, also telling where each key was set."""
    merged: Level = {}
    if file is not None:
        merged.update(_file_level(file))
    merged.update(_env_level(env))
    merged.update(_flag_level(argv_values))
    values = {k: v for k, (v, _, _) in merged.items()}
    origins = {k: s for k, (_, s, _) in merged.items()}
    config = _build(values, origins, env)
    if config.join_token:
        try:
            parse_join_token(config.join_token, now_unix=now_unix)
        except JoinTokenError as exc:
            raise ConfigError(
                str(exc), key="join_token", source=origins.get("join_token")
            ) from None
    return LoadedConfig(config, origins, values)


def default_state_dir(env: Mapping[str, str]) -> str:
    """systemd's $STATE_DIRECTORY, else $XDG_STATE_HOME/meshd, else ~/.local/state/meshd."""
    if env.get("STATE_DIRECTORY"):
        return env["STATE_DIRECTORY"].split(":")[0]
    if env.get("XDG_STATE_HOME"):
        return os.path.join(env["XDG_STATE_HOME"], "meshd")
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "meshd")


_PATH_KEYS = (
    "state_dir",
    "mesh_secret_file",
    "api_key_file",
    "control_socket",
    "model",
    "model_cache_dir",
)


def _build(values: dict[str, Any], origins: dict[str, str], env: Mapping[str, str]) -> NodeConfig:
    top: dict[str, Any] = {k: v for k, v in values.items() if "." not in k}
    top.setdefault("state_dir", default_state_dir(env))
    for key in _PATH_KEYS:
        if isinstance(top.get(key), str) and top[key].startswith("~"):
            top[key] = os.path.expanduser(top[key])
    if isinstance(top["state_dir"], str) and not top.get("control_socket"):
        top["control_socket"] = os.path.join(top["state_dir"], "control.sock")
    defaults = NodeConfig(state_dir="/")
    for table, type_ in TABLES.items():
        sub = {k.partition(".")[2]: v for k, v in values.items() if k.startswith(table + ".")}
        # A table's unset keys keep their defaults; a table with no default (`emulate`) that
        # is not set at all stays unset.
        default = getattr(defaults, table)
        if sub or default is not None:
            base = msgspec.structs.asdict(default) if default is not None else {}
            top[table] = _convert(base | sub, type_, table, origins)
    return _convert(top, NodeConfig, "", origins)


def _convert(data: dict[str, Any], type_: type[_T], table: str, origins: dict[str, str]) -> _T:
    """msgspec.convert, turning every failure into a ConfigError naming the key and source."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__
        message = str(cause) if cause is not None else str(exc)
        field = getattr(cause, "key", None)
        key = f"{table}.{field}" if field and table else field or _key_in(message, table)
    message = re.sub(r" - at `\$[^`]*`$", "", message)
    # A table's checks name the field (`dead_after_s must be ...`): the error names the
    # dotted key (`lane.dead_after_s must be ...`).
    name = key.removeprefix(f"{table}.") if table else key
    if table and re.match(rf"{re.escape(name)}\b", message):
        message = key + message[len(name) :]
    elif key and not message.startswith(key):
        message = f"{key}: {message}"
    raise ConfigError(message, key=key, source=_blame(key, message, origins)) from None


def _key_in(message: str, table: str) -> str:
    """The dotted key a validation message is about (its `$.path`, or the first key it names)."""
    path = re.search(r"at `\$\.([\w.]+)`", message)
    if path:
        return f"{table}.{path.group(1)}" if table else path.group(1)
    found = _keys_named(message, table)
    return found[0] if found else table


def _keys_named(message: str, table: str) -> list[str]:
    """Keys of `table` ("" = top level) that `message` names, in the order they appear."""
    prefix = f"{table}." if table else ""
    hits = []
    for key in KEYS:
        name = key.removeprefix(prefix)
        if key.startswith(prefix) and "." not in name:
            match = re.search(rf"(?<![\w.]){name}\b", message)
            if match:
                hits.append((match.start(), key))
    return [key for _, key in sorted(hits)]


def _blame(key: str, message: str, origins: Mapping[str, str]) -> str | None:
    """Where the offending value was set: the key's own source, else that of another key the
    message names (a cross-field check such as api_host without api_key), else None."""
    table = key.rpartition(".")[0]
    for candidate in [key, *_keys_named(message, table)]:
        if candidate in origins:
            return origins[candidate]
    return None
