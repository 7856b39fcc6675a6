"""Daemon configuration: precedence, unknown keys named with their source, validation, docs."""

from __future__ import annotations

import argparse
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from meshd.config import (
    KEYS,
    ConfigError,
    NodeConfig,
    add_config_arguments,
    config_cli_values,
    env_name,
    flag_name,
    load_config,
    load_config_from_args,
    load_config_sources,
    render,
)
from meshd.config.tables import NatDialConfig
from meshd.mesh.discovery import DiscoveryConfig
from meshd.mesh.identity import NodeIdentity
from meshd.mesh.jointoken import make_join_token
from meshd.mesh.membership_config import MembershipConfig
from meshd.net.emulator import LinkProfile
from meshd.plan.inputs import PlannerConfig
from meshd.speculative.config import SpecConfig
from meshd.stage.host import StageHostConfig
from protocol.config import LaneConfig
from protocol.punch import PunchConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SECRET = "mesh-secret-for-tests-0123456789"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with a state dir of the test's own and nothing else."""
    return {"MESHD_STATE_DIR": str(tmp_path / "state")}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(argv)


def test_precedence_default_file_env_flags(tmp_path: Path, env: dict[str, str]) -> None:
    file = _write(
        tmp_path / "meshd.toml",
        """
        api_port = 8000
        listen_port = 8001
        log_level = "debug"
        [lane]
        dead_after_s = 2.0
        ping_interval_s = 0.5
        [spec]
        window_max_tokens = 6
        ngram_max = 5
        """,
    )
    env |= {
        "MESHD_API_PORT": "8100",
        "MESHD_LISTEN_PORT": "8101",
        "MESHD_LANE__DEAD_AFTER_S": "3.0",
        "MESHD_SPEC__WINDOW_MAX_TOKENS": "7",
    }
    flags = {"api_port": 8200, "lane.dead_after_s": 4.0, "spec.window_max_tokens": 3}
    loaded = load_config_sources(flags, env, file)
    c = loaded.config
    assert c.api.port == 8200  # flag > env > file
    assert c.listen_port == 8101  # env > file
    assert c.log_level == "debug"  # file > default
    assert c.api.host == "127.0.0.1"  # default
    assert c.lane.dead_after_s == 4.0  # nested flag
    assert c.lane.ping_interval_s == 0.5  # the rest of the file's [lane] table stays
    assert c.lane.handshake_timeout_s == LaneConfig().handshake_timeout_s
    assert (c.spec.window_max_tokens, c.spec.ngram_max) == (3, 5)
    assert c.spec.mtp_depth == SpecConfig().mtp_depth
    assert loaded.origins["api.port"] == "flag --api-port"
    assert loaded.origins["listen_port"] == "env MESHD_LISTEN_PORT"
    assert loaded.origins["log_level"] == f"config file {file}"
    assert loaded.origins["spec.window_max_tokens"] == "flag --speculative-window-max-tokens"
    assert "api.host" not in loaded.origins


def test_precedence_through_the_command_line_parser(tmp_path: Path, env: dict[str, str]) -> None:
    file = _write(tmp_path / "meshd.toml", "api_port = 8000\n[mdns]\nenabled = true\n")
    env |= {"MESHD_CONFIG": str(file), "MESHD_API_PORT": "8100", "MESHD_LANE__DEAD_AFTER_S": "3"}
    args = _parse(["--api-port", "8200", "--no-mdns-enabled", "--speculative-strategy", "mtp"])
    c = load_config_from_args(args, env)
    assert (c.api.port, c.mdns.enabled, c.lane.dead_after_s) == (8200, False, 3.0)
    assert c.spec.strategy == "mtp"
    # Without the flags, the environment wins over the file ($MESHD_CONFIG names the file).
    c = load_config_from_args(_parse([]), env)
    assert (c.api.port, c.mdns.enabled) == (8100, True)
    # --config beats $MESHD_CONFIG.
    other = _write(tmp_path / "other.toml", "listen_port = 9999\n")
    c = load_config_from_args(_parse(["--config", str(other)]), env)
    assert (c.listen_port, c.api.port) == (9999, 8100)


def test_defaults_and_state_dir_resolution(tmp_path: Path) -> None:
    c = load_config({}, {"HOME": "/home/ann"}, None)
    assert c.state_dir == "/home/ann/.local/state/meshd"
    assert c.control_socket == "/home/ann/.local/state/meshd/control.sock"
    assert c == NodeConfig(state_dir=c.state_dir, control_socket=c.control_socket)
    assert c.emulate is None and c.layers is None and c.mdns.enabled
    assert (c.listen_host, c.listen_port, c.api.host) == ("0.0.0.0", 7391, "127.0.0.1")
    xdg = load_config({}, {"HOME": "/home/ann", "XDG_STATE_HOME": "/xdg"}, None)
    assert xdg.state_dir == "/xdg/meshd"
    systemd = {"HOME": "/root", "XDG_STATE_HOME": "/xdg", "STATE_DIRECTORY": "/var/lib/meshd"}
    assert load_config({}, systemd, None).state_dir == "/var/lib/meshd"
    assert load_config({"state_dir": "~/m"}, {"HOME": "/h"}, None).state_dir.endswith("/m")
    explicit = load_config({"control_socket": str(tmp_path / "c.sock")}, {"HOME": "/h"}, None)
    assert explicit.control_socket_path() == tmp_path / "c.sock"


def test_unknown_key_in_file_is_named_with_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    cases = {
        "api_prot = 1\n": ("api_prot", "did you mean 'api_port'"),
        "[lane]\ndead_aftr_s = 1.0\n": ("lane.dead_aftr_s", "did you mean 'dead_after_s'"),
        "[spec]\nwindow_size = 4\n": ("spec.window_size", "known keys in [spec]"),
        "[gossip]\nfanout = 3\n": ("gossip", "known keys"),
    }
    for text, (key, hint) in cases.items():
        file = _write(tmp_path / "bad.toml", text)
        with pytest.raises(ConfigError) as err:
            load_config({}, env, file)
        assert err.value.key == key
        assert err.value.source == f"config file {file}"
        assert repr(key) in str(err.value) and hint in str(err.value)
        assert str(file) in str(err.value)


def test_unknown_key_in_env_is_named_with_the_variable(env: dict[str, str]) -> None:
    for name, key in [
        ("MESHD_API_PROT", "api_prot"),
        ("MESHD_LANE__DEAD_AFTR_S", "lane.dead_aftr_s"),
        ("MESHD_LANE_DEAD_AFTER_S", "lane_dead_after_s"),  # a single underscore is not nesting
        ("MESHD_GOSSIP__FANOUT", "gossip.fanout"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config({}, env | {name: "1"}, None)
        assert (err.value.key, err.value.source) == (key, f"env {name}")
        assert f"env {name}" in str(err.value)
    with pytest.raises(
        ConfigError, match=r"no table \[gossip\]; tables: api, mdns, membership, lane, spec"
    ):
        load_config({}, env | {"MESHD_GOSSIP__FANOUT": "3"}, None)
    with pytest.raises(ConfigError, match=r"lane is a table.*MESHD_LANE__<KEY>"):
        load_config({}, env | {"MESHD_LANE": "x"}, None)
    # Other variables, the one naming the file and the process's kernel choices are not keys.
    assert load_config({}, env | {"PATH": "/bin", "MESHDX": "1", "MESHD_CONFIG": ""}, None)
    kernels = {"MESHD_QUANT_KERNELS": "torch", "MESHD_KERNEL_DIR": "/tmp/k"}
    assert load_config({}, env | kernels, None)


def test_env_values_are_parsed_by_the_field_type(env: dict[str, str]) -> None:
    env |= {
        "MESHD_MDNS__ENABLED": "off",
        "MESHD_MDNS__INTERFACES": "127.0.0.1, 10.0.0.1",
        "MESHD_JOIN": "10.0.0.2:7391,[fd00::2]:7400,gpu-box",
        "MESHD_LAYERS": "0,12",
        "MESHD_MEMORY_BUDGET_BYTES": "8_000_000_000",
        "MESHD_LANE__PMTU_PROBE_LADDER_BYTES": "4096,8192",
        "MESHD_LANE__PMTU_PROBING": "no",
        "MESHD_EMULATE__DELAY_S": "2e-2",
        "MESHD_EMULATE__BANDWIDTH_BYTES_S": "",
        "MESHD_SPEC__MIN_SPEEDUP": "1.5",
    }
    c = load_config({}, env, None)
    assert c.mdns == type(c.mdns)(enabled=False, interfaces=("127.0.0.1", "10.0.0.1"))
    assert c.bootstrap_peers() == [("10.0.0.2", 7391), ("fd00::2", 7400), ("gpu-box", 7391)]
    assert c.layers == (0, 12)
    assert c.memory_budget_bytes == 8_000_000_000
    assert c.lane.pmtu_probe_ladder_bytes == (4096, 8192) and not c.lane.pmtu_probing
    assert c.emulate == LinkProfile(delay_s=0.02, bandwidth_bytes_s=None)
    assert c.spec.min_speedup == 1.5
    assert load_config({}, env | {"MESHD_JOIN": ""}, None).join == ()


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("MESHD_API_PORT", "80a", "api.port: expected an integer"),
        ("MESHD_MDNS__ENABLED", "maybe", "expected true or false"),
        ("MESHD_LAYERS", "4", "expected 2 comma-separated values"),
        ("MESHD_LANE__DEAD_AFTER_S", "soon", "expected a number"),
    ],
)
def test_bad_env_value_names_the_variable(
    env: dict[str, str], name: str, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config({}, env | {name: text}, None)
    assert err.value.source == f"env {name}"


def test_quantization_kv_dtype_and_threads_from_flags_env_and_file(
    tmp_path: Path, env: dict[str, str]
) -> None:
    c = load_config({}, env, None)
    assert (c.quantization, c.kv_dtype, c.threads) == ("auto", "auto", 0)
    env |= {"MESHD_KV_DTYPE": "float16", "MESHD_THREADS": "3"}
    file = _write(tmp_path / "q.toml", 'quantization = "int4"\n')
    c = load_config_from_args(_parse(["--config", str(file)]), env)
    assert (c.quantization, c.kv_dtype, c.threads) == ("int4", "float16", 3)
    c = load_config_from_args(_parse(["--config", str(file), "--quantization", "int8"]), env)
    assert c.quantization == "int8"


def test_bad_values_name_the_key_and_where_it_was_set(tmp_path: Path, env: dict[str, str]) -> None:
    file = _write(tmp_path / "m.toml", 'api_port = "eighty"\n')
    with pytest.raises(ConfigError, match=r"api.port: Expected `int`, got `str`") as err:
        load_config({}, env, file)
    assert err.value.source == f"config file {file}"
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"api.port": 70000}, "api.port", "0..65535"),
        ({"lane.dead_after_s": -1.0}, "lane.dead_after_s", "positive finite"),
        ({"emulate.loss": 2.0}, "emulate.loss", r"within \[0, 1\]"),
        ({"spec.window_max_tokens": 100}, "spec.window_max_tokens", r"0\.\.64"),
        ({"device": "gpu"}, "device", "cuda:N"),
        ({"dtype": "int4"}, "dtype", "bfloat16"),
        ({"quantization": "q3_k"}, "quantization", "auto, none, int8, int4"),
        ({"kv_dtype": "int8"}, "kv_dtype", "float16"),
        ({"threads": -1}, "threads", ">= 0"),
        ({"log_format": "xml"}, "log_format", "json"),
        ({"layers": (5, 5)}, "layers", "start < stop"),
        ({"join": ("10.0.0.1:0",)}, "join", "1..65535"),
        ({"listen_host": "example.com"}, "listen_host", "not an IP address"),
        ({"memory_budget_bytes": -1}, "memory_budget_bytes", ">= 0"),
        ({"prefetch_max_bytes": -1}, "prefetch_max_bytes", ">= 0"),
        ({"revoked_keys": ("abc",)}, "revoked_keys", "64 hex digits"),
        ({"admitted_keys": ("ff" * 32,)}, "admitted_keys", "not an Ed25519 public key"),
    ]
    for flags, key, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            load_config(flags, env, None)
        assert err.value.key == key, flags
        assert err.value.source == f"flag {flag_name(key)}", flags


def test_cross_field_errors_blame_the_key_that_was_set(env: dict[str, str]) -> None:
    # ping_interval_s must stay below dead_after_s: the operator set dead_after_s.
    with pytest.raises(ConfigError, match="ping_interval_s must be below dead_after_s") as err:
        load_config({}, env | {"MESHD_LANE__DEAD_AFTER_S": "0.2"}, None)
    assert err.value.source == "env MESHD_LANE__DEAD_AFTER_S"
    with pytest.raises(ConfigError, match=r"window_min_tokens .* must not exceed") as err:
        load_config({"spec.window_max_tokens": 0}, env, None)
    assert err.value.source == "flag --speculative-window-max-tokens"


def test_api_beyond_loopback_needs_a_key(tmp_path: Path, env: dict[str, str]) -> None:
    for host in ("0.0.0.0", "192.168.1.5", "::"):
        with pytest.raises(ConfigError, match=r"api.key \(or key_file\) must be set") as err:
            load_config({}, env | {"MESHD_API_HOST": host}, None)
        assert err.value.key == "api.key"
        assert err.value.source == "env MESHD_API_HOST"
    key = "k" * 32
    c = load_config({"api_key": key}, env | {"MESHD_API_HOST": "0.0.0.0"}, None)
    assert c.read_api_key() == key and not c.api.is_loopback
    key_file = _write(tmp_path / "api.key", key + "\n")
    key_file.chmod(0o600)
    c = load_config({"api_host": "0.0.0.0", "api_key_file": str(key_file)}, env, None)
    assert c.read_api_key() == key
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        c = load_config({"api_host": host}, env, None)
        assert c.api.is_loopback and c.read_api_key() is None
    with pytest.raises(ConfigError, match="too short"):
        load_config({"api_key": "hunter2"}, env, None)


def test_api_allowed_hosts_and_cors_origins_from_file_env_and_flags(
    tmp_path: Path, env: dict[str, str]
) -> None:
    c = load_config({}, env, None)
    assert c.api.allowed_hosts == () and c.api.cors_origins == ()
    file = _write(tmp_path / "m.toml", 'api_allowed_hosts = ["mesh.lan", "[fd00::2]:7392"]\n'
                  'api_cors_origins = ["https://app.example.com"]\n')  # fmt: skip
    c = load_config({}, env, file)
    assert c.api.allowed_hosts == ("mesh.lan", "[fd00::2]:7392")
    assert c.api.cors_origins == ("https://app.example.com",)
    c = load_config({}, env | {"MESHD_API_ALLOWED_HOSTS": "a.lan,b.lan:8000"}, None)
    assert c.api.allowed_hosts == ("a.lan", "b.lan:8000")
    args = _parse(["--api-allowed-hosts", "proxy.example", "--api-cors-origins",
                   "http://localhost:3000,https://app.example.com"])  # fmt: skip
    c = load_config(config_cli_values(args), env, None)
    assert c.api.allowed_hosts == ("proxy.example",)
    assert c.api.cors_origins == ("http://localhost:3000", "https://app.example.com")


def test_api_table_and_its_flat_spellings_set_the_same_keys(
    tmp_path: Path, env: dict[str, str]
) -> None:
    table = _write(tmp_path / "t.toml", '[api]\nport = 8000\nallowed_hosts = ["mesh.lan"]\n')
    flat = _write(tmp_path / "f.toml", 'api_port = 8000\napi_allowed_hosts = ["mesh.lan"]\n')
    assert load_config({}, env, table) == load_config({}, env, flat)
    assert load_config({}, env, table).api.allowed_hosts == ("mesh.lan",)
    for name in ("MESHD_API_PORT", "MESHD_API__PORT"):
        loaded = load_config_sources({}, env | {name: "8100"}, table)
        assert loaded.config.api.port == 8100 and loaded.origins["api.port"] == f"env {name}"
    # The flags are one spelling (`--api-port` is `api.port`); code may pass either key.
    assert load_config_from_args(_parse(["--api-port", "8200"]), env).api.port == 8200
    assert load_config({"api_port": 8300}, env, None).api.port == 8300
    assert load_config({"api": {"port": 8400}}, env, None).api.port == 8400


def test_both_spellings_of_an_api_key_in_one_place_is_an_error(
    tmp_path: Path, env: dict[str, str]
) -> None:
    file = _write(tmp_path / "both.toml", "api_port = 8000\n[api]\nport = 8001\n")
    with pytest.raises(ConfigError, match=r"api.port is set twice.*api_port.*\[api\] port") as err:
        load_config({}, env, file)
    assert (err.value.key, err.value.source) == ("api.port", f"config file {file}")
    assert str(file) in str(err.value)
    both = {"MESHD_API_PORT": "1", "MESHD_API__PORT": "2"}
    with pytest.raises(ConfigError, match=r"set twice.*MESHD_API_?_PORT and as MESHD_API_?_PORT"):
        load_config({}, env | both, None)
    with pytest.raises(ConfigError, match="set twice"):
        load_config({"api_port": 1, "api.port": 2}, env, None)
    # Different places are precedence, not a conflict.
    flat = _write(tmp_path / "flat.toml", "api_port = 1\n")
    assert load_config({}, env | {"MESHD_API__PORT": "2"}, flat).api.port == 2


def test_spec_table_errors_name_file_table_and_key(tmp_path: Path, env: dict[str, str]) -> None:
    cases = {
        "[spec]\nwindow_max_tokens = 100\n": (
            "spec.window_max_tokens",
            r"spec.window_max_tokens = 100 is out of range; allowed 0\.\.64",
        ),
        '[spec]\nmax_pipeline_depth = "2"\n': (
            "spec.max_pipeline_depth",
            r"spec.max_pipeline_depth: Expected `int`, got `str`",
        ),
        '[spec]\nstrategy = "eagle"\n': (
            "spec.strategy",
            r"spec.strategy = 'eagle' is unknown; allowed: disabled",
        ),
        '[spec]\nstrategy = "draft"\n': (
            "spec.strategy",
            r"spec.strategy 'draft' needs a draft model",
        ),
        "[spec]\nngram_min = 6\n": (
            "spec.ngram_min",
            r"spec.ngram_min \(6\) must not exceed ngram_max \(4\)",
        ),
    }
    for text, (key, message) in cases.items():
        file = _write(tmp_path / "spec.toml", text)
        with pytest.raises(ConfigError, match=message) as err:
            load_config({}, env, file)
        assert (err.value.key, err.value.source) == (key, f"config file {file}"), text
        assert str(err.value).endswith(f"(set by config file {file})")
    # A float key takes a TOML integer, as every other table's float keys do.
    file = _write(tmp_path / "ok.toml", "[spec]\nmin_speedup = 2\n")
    assert load_config({}, env, file).spec.min_speedup == 2.0


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("api_allowed_hosts", "http://mesh.lan", "host name or address"),
        ("api_allowed_hosts", "mesh.lan:0", "1..65535"),
        ("api_allowed_hosts", "*.lan", "host name or address"),
        ("api_cors_origins", "null", "not an origin"),
        ("api_cors_origins", "app.example.com", "not an origin"),
        ("api_cors_origins", "https://app.example.com/", "no path"),
    ],
)
def test_bad_api_hosts_and_origins_name_the_key_and_source(
    env: dict[str, str], key: str, value: str, match: str
) -> None:
    name = "MESHD_" + key.upper()  # the flat spelling, MESHD_API_ALLOWED_HOSTS
    with pytest.raises(ConfigError, match=match) as err:
        load_config({}, env | {name: value}, None)
    assert (err.value.key, err.value.source) == (key.replace("_", ".", 1), f"env {name}")


def test_mesh_secret_sources(tmp_path: Path, env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="no mesh secret"):
        load_config({}, env, None).read_mesh_secret()
    assert load_config({"mesh_secret": SECRET}, env, None).read_mesh_secret() == SECRET
    secret_file = _write(tmp_path / "mesh.secret", f"  {SECRET}\n")
    secret_file.chmod(0o640)
    c = load_config({"mesh_secret_file": str(secret_file)}, env, None)
    assert c.read_mesh_secret() == SECRET
    secret_file.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"readable by anyone.*chmod 600 '{secret_file}'"):
        c.read_mesh_secret()
    with pytest.raises(ConfigError, match="not both"):
        load_config({"mesh_secret": SECRET, "mesh_secret_file": str(secret_file)}, env, None)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({"mesh_secret_file": str(tmp_path / "nope")}, env, None).read_mesh_secret()


def test_join_token_supplies_secret_and_peers(env: dict[str, str]) -> None:
    token = make_join_token(SECRET, ["10.0.0.5:7391"], expires_unix=2_000_000)
    flags = {"join_token": token, "join": ("10.0.0.6",)}
    c = load_config(flags, env, None, now_unix=1_000_000)
    assert c.read_mesh_secret() == SECRET
    assert c.bootstrap_peers() == [("10.0.0.6", 7391), ("10.0.0.5", 7391)]
    with pytest.raises(ConfigError, match="expired") as err:
        load_config(flags, env, None, now_unix=3_000_000)
    assert (err.value.key, err.value.source) == ("join_token", "flag --join-token")
    typo = token[:-3] + ("A" if token[-3] != "A" else "B") + token[-2:]
    with pytest.raises(ConfigError, match="damaged"):
        load_config({"join_token": typo}, env, None, now_unix=1_000_000)
    with pytest.raises(ConfigError, match="carries the mesh secret"):
        load_config({"join_token": token, "mesh_secret": "x" * 20}, env, None, now_unix=0)


def test_admission_lists_are_public_keys(env: dict[str, str]) -> None:
    a, b = NodeIdentity(bytes(32)), NodeIdentity(bytes(range(32)))
    c = load_config(
        {}, env | {"MESHD_REVOKED_KEYS": f"{a.public_key.hex()},{b.public_key.hex()}"}, None
    )
    assert c.revoked_public_keys() == (a.public_key, b.public_key)
    assert c.admitted_public_keys() == ()


def test_control_socket_path_must_fit_a_unix_socket(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at most 107") as err:
        load_config({"state_dir": "/" + "s" * 100}, {}, None)
    assert err.value.key == "control_socket"


def test_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--layers", "1"])
    assert (
        "argument --layers: expected 2 comma-separated values, got '1'" in capsys.readouterr().err
    )


def test_every_key_has_a_flag_and_an_env_name() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = parser._option_string_actions
    for key in KEYS:
        assert flag_name(key) in flags, key
        assert env_name(key).startswith("MESHD_") and env_name(key).isupper()
    assert "--config" in flags and "--no-mdns-enabled" in flags
    args = parser.parse_args(["--lane-pmtu-probe-ladder-bytes", "4096,8192", "--layers", "2,4"])
    assert config_cli_values(args) == {
        "lane.pmtu_probe_ladder_bytes": (4096, 8192),
        "layers": (2, 4),
    }


def test_render_redacts_secrets_and_round_trips(tmp_path: Path, env: dict[str, str]) -> None:
    api_key = "api-key-for-tests-0123456789"
    token = make_join_token(SECRET, ["10.0.0.5:7391"])
    c = load_config({"api_key": api_key, "join_token": token, "mesh_secret": SECRET}, env, None)
    for text in (render(c), render(c, as_json=True)):
        assert SECRET not in text and api_key not in text and token not in text
        assert text.count("<redacted>") == 3
    assert json.loads(render(c, as_json=True))["lane"]["dead_after_s"] == 1.5
    # Logs and tracebacks show the repr: no secrets there either.
    assert SECRET not in repr(c) and api_key not in repr(c) and token not in repr(c)
    assert "port=7392" in repr(c) and "<redacted>" in str(c)
    plain = load_config(
        {"layers": (0, 3), "emulate.delay_s": 0.01, "join": ("10.0.0.1:1",)},
        env | {"MESHD_MDNS__INTERFACES": "127.0.0.1", "MESHD_SPEC__STRATEGY": "mtp"},
        None,
    )
    rendered = _write(tmp_path / "rendered.toml", render(plain))
    assert load_config({}, {}, rendered) == plain
    no_emulator = load_config({}, env, None)
    assert load_config({}, {}, _write(tmp_path / "r2.toml", render(no_emulator))) == no_emulator


# --- the daemon's timers ----------------------------------------------------------------------


def test_daemon_timers_are_keys_with_the_defaults_they_had(env: dict[str, str]) -> None:
    config = load_config({}, env, None)
    assert (config.recovery_timeout_s, config.suspect_hold_s, config.drain_timeout_s) == (
        20.0,
        10.0,
        300.0,
    )
    assert config.membership == MembershipConfig()
    config = load_config(
        {"drain_timeout_s": 2.5}, env | {"MESHD_MEMBERSHIP__GOSSIP_INTERVAL_S": "0.5"}, None
    )
    assert config.drain_timeout_s == 2.5
    membership = config.membership
    assert membership.gossip_interval_s == 0.5
    assert membership.probe_interval_s == MembershipConfig().probe_interval_s


def test_daemon_timers_are_validated_naming_key_and_source(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({}, env | {"MESHD_DRAIN_TIMEOUT_S": "0"}, None)
    assert (err.value.key, err.value.source) == ("drain_timeout_s", "env MESHD_DRAIN_TIMEOUT_S")
    with pytest.raises(ConfigError, match="below probe_interval_s") as err:
        load_config({"membership.probe_timeout_s": 2.0}, env, None)
    assert err.value.key == "membership.probe_timeout_s"
    assert err.value.source == "flag --membership-probe-timeout-s"
    args = _parse(["--suspect-hold-s", "3", "--membership-suspicion-min-s", "2.5"])
    config = load_config_from_args(args, env)
    assert config.suspect_hold_s == 3.0 and config.membership.suspicion_min_s == 2.5


# --- the component tables ---------------------------------------------------------------------


def test_component_tables_default_to_what_the_daemon_ran_on(env: dict[str, str]) -> None:
    config = load_config({}, env, None)
    # The daemon planned with these two (from its former DaemonTuning), not PlannerConfig's own.
    assert config.planner == PlannerConfig(unknown_rtt_s=0.01, reuse_tolerance_fraction=math.inf)
    assert (config.stage, config.nat, config.punch) == (
        StageHostConfig(),
        NatDialConfig(),
        PunchConfig(),
    )
    assert config.mdns == DiscoveryConfig() and config.context_tokens == 0


def test_component_tables_from_file_env_and_flags(tmp_path: Path, env: dict[str, str]) -> None:
    file = _write(
        tmp_path / "c.toml",
        "[planner]\nmax_stages = 4\n[stage]\nmax_sessions = 8\n[punch]\nopen_ttl = 3\n"
        "[mdns]\nresolve_timeout_s = 2.0\n[membership]\ndead_retention_s = 90.0\n",
    )
    args = _parse(["--planner-unknown-rtt-s", "0.05", "--no-stage-batching", "--nat-yield-s", "0"])
    loaded = load_config_sources(
        config_cli_values(args), env | {"MESHD_CONTEXT_TOKENS": "2048"}, file
    )
    config = loaded.config
    assert config.planner.max_stages == 4 and config.planner.unknown_rtt_s == 0.05
    # A table set in part keeps the daemon's defaults for the rest.
    assert config.planner.reuse_tolerance_fraction == math.inf
    assert config.stage.max_sessions == 8 and config.stage.batching is False
    assert config.punch.open_ttl == 3 and config.nat.yield_s == 0.0
    assert config.mdns.resolve_timeout_s == 2.0 and config.mdns.enabled
    assert config.membership.dead_retention_s == 90.0 and config.context_tokens == 2048
    assert loaded.origins["nat.yield_s"] == "flag --nat-yield-s"
    assert loaded.origins["stage.max_sessions"] == f"config file {file}"


@pytest.mark.parametrize(
    ("env_var", "value", "key", "match"),
    [
        ("MESHD_PLANNER__EXACT_ORDER_MAX_STAGES", "13", "planner.exact_order_max_stages", "Held"),
        ("MESHD_STAGE__MAX_SESSIONS", "0", "stage.max_sessions", ">= 1"),
        ("MESHD_STAGE__PREFIX_CACHE_ENTRIES", "0", "stage.prefix_cache_entries", ">= 1"),
        ("MESHD_PUNCH__OPEN_TTL", "0", "punch.open_ttl", "1..255"),
        ("MESHD_NAT__MAX_INTRODUCERS", "0", "nat.max_introducers", ">= 1"),
        ("MESHD_MDNS__RESOLVE_WORKERS", "0", "mdns.resolve_workers", "1..1024"),
        ("MESHD_LANE__DEAD_AFTER_S", "0", "lane.dead_after_s", "positive"),
        ("MESHD_MEMBERSHIP__GOSSIP_FANOUT", "0", "membership.gossip_fanout", "at least 1"),
        ("MESHD_CONTEXT_TOKENS", "-1", "context_tokens", ">= 0"),
        ("MESHD_API_MAX_BODY_BYTES", "0", "api.max_body_bytes", ">= 1"),
        ("MESHD_API__BODY_TIMEOUT_S", "0", "api.body_timeout_s", "positive"),
        ("MESHD_SPEC__NGRAM_MAX", "20", "spec.ngram_max", r"1\.\.16"),
        ("MESHD_FETCH__HOLDER_WAIT_S", "0", "fetch.holder_wait_s", "> 0"),
        ("MESHD_BULK__HISTORY", "2", "bulk.history", ">= 4"),
    ],
)
def test_every_table_validates_naming_key_and_source(
    env: dict[str, str], env_var: str, value: str, key: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        load_config({}, env | {env_var: value}, None)
    assert (err.value.key, err.value.source) == (key, f"env {env_var}")
    assert str(err.value).startswith(key)


# --- docs/configuration.md ------------------------------------------------------------------

_ROW = re.compile(r"^\| `([a-z_.]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$")
# Keys whose default depends on other settings or is "not set".
_NON_LITERAL_DEFAULTS = {"state_dir", "control_socket", "layers", "emulate.bandwidth_bytes_s"}


def _doc_rows() -> dict[str, tuple[str, str, str]]:
    rows: dict[str, tuple[str, str, str]] = {}
    for line in DOCS.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            key, _type, default, names, _what = (g.strip() for g in match.groups())
            assert key not in rows, f"{key} documented twice"
            rows[key] = (default, names, _what)
    return rows


def _default(key: str) -> Any:
    config = NodeConfig(state_dir="/s")
    table, _, name = key.rpartition(".")
    holder = getattr(config, table) if table else config
    if holder is None:
        holder = LinkProfile()
    value = getattr(holder, name)
    if isinstance(value, float):
        return value  # JSON would make inf null
    return msgspec.json.decode(msgspec.json.encode(value))


def test_docs_list_every_key_and_nothing_else() -> None:
    rows = _doc_rows()
    assert sorted(rows) == sorted(KEYS)


def test_docs_list_each_key_under_its_table() -> None:
    heading = ""
    for line in DOCS.read_text().splitlines():
        if line.startswith("### "):
            heading = line
        match = _ROW.match(line)
        if match:
            table = match.group(1).rpartition(".")[0]
            if table:
                assert f"`[{table}]`" in heading, (match.group(1), heading)
            else:
                assert "`[" not in heading, (match.group(1), heading)


def test_docs_defaults_and_names_match_the_code() -> None:
    for key, (default, names, _what) in _doc_rows().items():
        assert re.findall(r"`([^`]+)`", names)[:2] == [env_name(key), flag_name(key)], key
        if key in _NON_LITERAL_DEFAULTS:
            continue
        literal = re.fullmatch(r"`(.+)`", default)
        assert literal, f"{key}: default {default!r} is not a TOML literal"
        assert tomllib.loads(f"v = {literal.group(1)}")["v"] == _default(key), key


def test_docs_toml_examples_load(tmp_path: Path) -> None:
    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        config = load_config({}, {"HOME": str(tmp_path)}, _write(tmp_path / f"{i}.toml", block))
        assert isinstance(config, NodeConfig)


# --- meshd config show ------------------------------------------------------------------------


def test_config_show_prints_what_serve_would_run_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshd.cli.main import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MESHD_LANE__DEAD_AFTER_S", "2.5")
    key = "api-key-for-tests-0123456789"
    file = _write(tmp_path / "m.toml", f'api_port = 8000\n[api]\nkey = "{key}"\n')
    assert main(["config", "show", "--config", str(file), "--api-host", "0.0.0.0"]) == 0
    shown = capsys.readouterr().out
    assert key not in shown and 'key = "<redacted>"' in shown
    loaded = tomllib.loads(shown)
    assert loaded["api"]["port"] == 8000 and loaded["api"]["host"] == "0.0.0.0"
    assert loaded["lane"]["dead_after_s"] == 2.5
    assert main(["config", "show", "--json", "--config", str(file)]) == 0
    assert json.loads(capsys.readouterr().out)["api"]["port"] == 8000
    both = _write(tmp_path / "both.toml", "api_port = 1\n[api]\nport = 2\n")
    assert main(["config", "show", "--config", str(both)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "api.port is set twice" in err and str(both) in err
