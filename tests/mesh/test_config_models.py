"""`model` is one model or a list: in the file, repeated on the command line, comma-separated
in the environment; a single one stays a plain string."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from meshd.config import ConfigError, add_config_arguments, load_config_from_args


def _load(argv: list[str], env: dict[str, str]) -> object:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return load_config_from_args(parser.parse_args(argv), env)


def test_model_is_one_or_a_list_from_every_source(tmp_path: Path) -> None:
    env = {"MESHD_STATE_DIR": str(tmp_path / "state")}
    one = _load(["--model", "/m/a"], env)
    assert one.model == "/m/a" and one.models == ("/m/a",)  # type: ignore[attr-defined]
    two = _load(["--model", "/m/a", "--model", "/m/b"], env)
    assert two.models == ("/m/a", "/m/b")  # type: ignore[attr-defined]
    builtin_and_b = _load(["--model", "", "--model", "/m/b"], env)
    assert builtin_and_b.models == ("", "/m/b")  # type: ignore[attr-defined]
    assert _load([], {**env, "MESHD_MODEL": "/m/a,/m/b"}).models == ("/m/a", "/m/b")  # type: ignore[attr-defined]
    assert _load([], env).models == ("",)  # type: ignore[attr-defined]
    file = tmp_path / "meshd.toml"
    file.write_text('model = ["/m/a", "/m/c"]\n')
    assert _load(["--config", str(file)], env).models == ("/m/a", "/m/c")  # type: ignore[attr-defined]
    file.write_text('model = "/m/a"\n')
    assert _load(["--config", str(file)], env).model == "/m/a"  # type: ignore[attr-defined]


def test_a_model_listed_twice_or_none_is_refused(tmp_path: Path) -> None:
    env = {"MESHD_STATE_DIR": str(tmp_path / "state")}
    with pytest.raises(ConfigError, match="listed twice"):
        _load(["--model", "/m/a", "--model", "/m/a"], env)
    file = tmp_path / "meshd.toml"
    file.write_text("model = []\n")
    with pytest.raises(ConfigError, match="at least one model"):
        _load(["--config", str(file)], env)
