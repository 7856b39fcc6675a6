"""`ModelConfig`: the validated shape of a Llama-family checkpoint, parsed from `config.json`.

One struct covers every supported family; the family only decides defaults and which optional
pieces exist (q/k/v biases for Qwen2, per-head q/k RMSNorm for Qwen3, sliding windows for
Mistral). Both the transformers v4 layout (`rope_theta` + `rope_scaling`) and the v5 layout
(`rope_parameters`) are read.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import msgspec

from meshd.model.errors import InvalidConfig, MissingFile, UnsupportedArchitecture

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class RopeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Rotary embedding parameters; fields unused by `rope_type` keep their defaults."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the runtime needs to build and check a decoder, validated."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per decoder layer: True where that layer attends only within `sliding_window`.
    sliding_layers: tuple[bool, ...] = ()
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_file(cls, path: pathlib.Path) -> ModelConfig:
        """Read and validate a `config.json`."""
        if not path.is_file():
            raise MissingFile(f"{path}: config.json not found (is this a checkpoint directory?)")
        try:
            raw = msgspec.json.decode(path.read_bytes())
        except msgspec.DecodeError as exc:
            raise InvalidConfig(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise InvalidConfig(f"{path}: expected a JSON object at top level")
        return parse_config(raw, source=str(path))

    def window_for_layer(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None for full causal attention."""
        if self.sliding_window is not None and self.sliding_layers[layer]:
            return self.sliding_window
        return None


def parse_config(raw: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Validate a `config.json` mapping into a `ModelConfig` (typed errors name the key)."""
    reader = _Reader(raw, source)
    family = _family(raw, source)
    hidden = reader.integer("hidden_size")
    heads = reader.integer("num_attention_heads")
    kv_heads = reader.integer("num_key_value_heads", heads)
    default_head_dim = 128 if family == "qwen3" else hidden // heads
    head_dim = reader.integer("head_dim", default_head_dim)
    layers = reader.integer("num_hidden_layers")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedArchitecture(
            f"{source}: hidden_act {act!r} (only SwiGLU/silu is supported)"
        )
    if heads % kv_heads:
        raise InvalidConfig(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    if head_dim % 2:
        raise InvalidConfig(f"{source}: head_dim ({head_dim}) must be even for RoPE")
    window, sliding = _sliding(raw, reader, family, layers, source)
    attention_bias = reader.flag("attention_bias", False)
    return ModelConfig(
        family=family,
        vocab_size=reader.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=reader.integer("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=reader.number("rms_norm_eps", 1e-6),
        max_position_embeddings=reader.integer("max_position_embeddings", 2048),
        rope=_rope(raw, source),
        tie_word_embeddings=reader.flag("tie_word_embeddings", False),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=reader.flag("mlp_bias", False),
        qk_norm=family == "qwen3",
        sliding_window=window,
        sliding_layers=sliding,
        num_mtp_layers=reader.integer("num_nextn_predict_layers", 0, minimum=0),
        bos_token_id=_optional_id(raw.get("bos_token_id"), "bos_token_id", source),
        eos_token_ids=_eos_ids(raw.get("eos_token_id"), source),
    )


def _family(raw: Mapping[str, Any], source: str) -> str:
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        raise InvalidConfig(f"{source}: 'architectures' must be a list")
    if model_type is None and architectures:
        model_type = _ARCHITECTURES.get(str(architectures[0]))
    if model_type not in FAMILIES:
        raise UnsupportedArchitecture(
            f"{source}: model_type {model_type!r} / architectures {architectures!r} is not "
            f"supported (supported: {', '.join(FAMILIES)})"
        )
    for arch in architectures:
        if _ARCHITECTURES.get(str(arch)) != model_type:
            raise UnsupportedArchitecture(
                f"{source}: architecture {arch!r} is not a {model_type} causal LM "
                f"(supported: {', '.join(_ARCHITECTURES)})"
            )
    return str(model_type)


def _rope(raw: Mapping[str, Any], source: str) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        # transformers v5 keeps theta and scaling together.
        scaling: Any = params
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = raw.get("rope_scaling") or {}
        theta = raw.get("rope_theta", 10000.0)
    if not isinstance(scaling, dict):
        raise InvalidConfig(f"{source}: rope_scaling must be an object or null")
    sub = _Reader(scaling, f"{source}: rope scaling")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitecture(
            f"{source}: rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedArchitecture(f"{source}: partial_rotary_factor != 1 is not supported")
    if not isinstance(theta, int | float) or theta <= 0:
        raise InvalidConfig(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    factor = sub.number("factor")
    if rope_type in ("linear", "dynamic"):
        return RopeConfig(rope_type=rope_type, theta=float(theta), factor=factor)
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=factor,
        low_freq_factor=sub.number("low_freq_factor"),
        high_freq_factor=sub.number("high_freq_factor"),
        original_max_position_embeddings=sub.integer("original_max_position_embeddings"),
    )


def _sliding(
    raw: Mapping[str, Any], reader: _Reader, family: str, layers: int, source: str
) -> tuple[int | None, tuple[bool, ...]]:
    full = (False,) * layers
    if family == "llama" or raw.get("sliding_window") is None:
        return None, full
    if family == "mistral":
        return reader.integer("sliding_window"), (True,) * layers
    # Qwen2/Qwen3: the window applies only when enabled, and only to some layers.
    if not raw.get("use_sliding_window", False):
        return None, full
    window = reader.integer("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = reader.integer("max_window_layers", 28, minimum=0)
        return window, tuple(i >= first for i in range(layers))
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise InvalidConfig(f"{source}: layer_types must list one type per layer ({layers})")
    bad = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
    if bad:
        raise UnsupportedArchitecture(f"{source}: layer type {bad[0]!r} is not supported")
    return window, tuple(t == "sliding_attention" for t in layer_types)


def _optional_id(value: Any, key: str, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, list):
        value = value[0] if value else None
        if value is None:
            return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidConfig(f"{source}: {key} must be a token id, got {value!r}")
    return value


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    ids = [_optional_id(v, "eos_token_id", source) for v in values]
    return tuple(i for i in ids if i is not None)


class _Reader:
    """Typed access to one JSON object, with errors that name the key."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self._raw = raw
        self._source = source

    def _get(self, key: str, default: Any) -> Any:
        value = self._raw.get(key, default)
        if value is None and default is not None:
            value = default
        if value is None:
            raise InvalidConfig(f"{self._source}: required key {key!r} is missing")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise InvalidConfig(
                f"{self._source}: {key} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise InvalidConfig(f"{self._source}: {key} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._raw.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidConfig(f"{self._source}: {key} must be true or false, got {value!r}")
        return value
