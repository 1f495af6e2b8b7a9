"""ModelSpec: the fields of a HF ``config.json`` that decode shapes depend on.

Kimi-K2.5 nests its text model under ``text_config`` (the top level describes the
vision-language wrapper); DeepSeek-V3 keeps everything at the top level. Both are
read by one function, :func:`load_model_spec`, through one table of required fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .files import UnreadableFile, read_json

__all__ = ["BUNDLED_MODELS_DIR", "ModelSpec", "QuantSpec", "bundled_model_names", "load_model_spec", "read_config",
           "resolve_model_path", "spec_from_config"]

BUNDLED_MODELS_DIR = Path(__file__).resolve().parent / "models"

# config key -> ModelSpec field; every one must be present (no silent defaults).
_REQUIRED_FIELDS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "top_k",
    "moe_intermediate_size": "moe_intermediate_size",
    "intermediate_size": "dense_intermediate_size",
    "first_k_dense_replace": "first_dense_layers",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "rms_norm_eps",
}
# Fields with a documented meaning when absent (DeepSeek-V2 configs omit some).
_OPTIONAL_FIELDS = {
    "n_shared_experts": ("num_shared_experts", 0),
    "n_group": ("num_expert_groups", 1),
    "topk_group": ("topk_groups", 1),
    "scoring_func": ("scoring_func", "softmax"),
    "topk_method": ("topk_method", "greedy"),
    "routed_scaling_factor": ("routed_scaling_factor", 1.0),
    "norm_topk_prob": ("norm_topk_prob", False),
    "moe_layer_freq": ("moe_layer_freq", 1),
    "rope_scaling": ("rope_scaling", None),
    "max_position_embeddings": ("max_positions", None),
}


@dataclass(frozen=True)
class QuantSpec:
    """How the routed experts' weights are stored.

    ``method`` is ``"bf16"`` for an unquantized model. ``ignore`` lists the
    compressed-tensors patterns of modules that stay in bf16.
    """

    method: str
    bits: int = 16
    group_size: int | None = None
    symmetric: bool = True
    format: str | None = None
    block_size: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    def is_quantized(self, module_name: str) -> bool:
        """Whether a module (e.g. ``model.layers.3.mlp.experts.7.down_proj``) is quantized.

        >>> QuantSpec("compressed-tensors", 4, 32, ignore=("re:.*self_attn.*",)).is_quantized("l.0.self_attn.o_proj")
        False
        """
        if self.method == "bf16":
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True

    @property
    def expert_weight_bytes_per_param(self) -> float:
        """Stored bytes per routed-expert weight, counting bf16 group scales."""
        if self.method == "bf16":
            return 2.0
        scale_bytes = 2.0 / self.group_size if self.group_size else 0.0
        return self.bits / 8 + scale_bytes


@dataclass(frozen=True)
class ModelSpec:
    """The decode-relevant part of a DeepSeek-V3-family config (MLA + MoE)."""

    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    first_dense_layers: int
    vocab_size: int
    rms_norm_eps: float
    num_shared_experts: int
    num_expert_groups: int
    topk_groups: int
    scoring_func: str
    topk_method: str
    routed_scaling_factor: float
    norm_topk_prob: bool
    moe_layer_freq: int
    rope_scaling: dict | None
    quant: QuantSpec
    max_positions: int | None = None  # max_position_embeddings: the longest context the model takes

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def bundled_model_names() -> list[str]:
    """Names of the configs shipped in ``decodebench/models/``."""
    return sorted(p.parent.name for p in BUNDLED_MODELS_DIR.glob("*/config.json"))


def resolve_model_path(model: str | Path) -> Path:
    """A bundled model name, a model directory or a config.json path -> the config.json path."""
    candidate = Path(model)
    if candidate.is_dir():
        candidate = candidate / "config.json"
    if candidate.is_file():
        return candidate
    bundled = BUNDLED_MODELS_DIR / str(model) / "config.json"
    if bundled.is_file():
        return bundled
    raise ConfigError(
        f"model {str(model)!r} is neither a config.json, a directory holding one, "
        f"nor a bundled model ({', '.join(bundled_model_names())})"
    )


def read_config(path: Path) -> dict:
    """The JSON object of the config.json at ``path``, through the one JSON reader; :class:`ConfigError`
    naming the file when it cannot be read or is not an object."""
    try:
        raw = read_json(path)
    except UnreadableFile as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return raw


def load_model_spec(model: str | Path) -> ModelSpec:
    """Parse a HF config.json into a :class:`ModelSpec`.

    >>> spec = load_model_spec("kimi-k2.5")
    >>> spec.num_experts, spec.top_k, spec.quant.group_size
    (384, 8, 32)
    """
    path = resolve_model_path(model)
    return spec_from_config(path, read_config(path))


def spec_from_config(path: Path, raw: dict) -> ModelSpec:
    """The :class:`ModelSpec` of the config ``raw`` read from ``path`` (which names the model and its errors)."""
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"{path}: 'text_config' must be an object")
    where = "text_config" if text is not raw else "config"
    missing = [key for key in _REQUIRED_FIELDS if text.get(key) is None]
    if missing:
        raise ConfigError(f"{path}: {where} lacks required field(s) {', '.join(missing)}")
    fields = {attr: text[key] for key, attr in _REQUIRED_FIELDS.items()}
    fields.update({attr: text.get(key, default) for key, (attr, default) in _OPTIONAL_FIELDS.items()})
    _check_types(path, where, fields)
    _check_counts(path, where, fields)
    architectures = text.get("architectures") or raw.get("architectures") or ["unknown"]
    quant_raw = text.get("quantization_config", raw.get("quantization_config"))
    return ModelSpec(
        name=path.parent.name,
        architecture=architectures[0],
        quant=_parse_quant(path, quant_raw),
        **fields,
    )


def _check_types(path: Path, where: str, fields: dict) -> None:
    float_fields = {"rms_norm_eps", "routed_scaling_factor"}
    for key, attr in list(_REQUIRED_FIELDS.items()) + [(k, v[0]) for k, v in _OPTIONAL_FIELDS.items()]:
        value = fields[attr]
        if attr in float_fields:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        elif attr in {"scoring_func", "topk_method"}:
            ok = isinstance(value, str)
        elif attr == "norm_topk_prob":
            ok = isinstance(value, bool)
        elif attr == "rope_scaling":
            ok = value is None or isinstance(value, dict)
        elif attr == "max_positions":
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            ok = ok and (value > 0 or attr in {"first_dense_layers", "num_shared_experts"})
        if not ok:
            raise ConfigError(f"{path}: {where} field {key!r} has an invalid value {value!r}")


# (smaller field, larger field): the router picks the first out of the second (experts; groups); the
# dense layers come first among the layers.
_AT_MOST = (("num_experts_per_tok", "n_routed_experts"), ("topk_group", "n_group"),
            ("first_k_dense_replace", "num_hidden_layers"))
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _check_counts(path: Path, where: str, fields: dict) -> None:
    """Refuse values that contradict each other or lie outside what the shapes can be built from: each
    fails only deep inside a kernel otherwise (a top-k over fewer experts: ``selected index k out of
    range``), long after the config was read, or as a traceback at collection."""
    attr = {**_REQUIRED_FIELDS, **{k: v[0] for k, v in _OPTIONAL_FIELDS.items()}}
    value = {key: fields[name] for key, name in attr.items()}
    for small, large in _AT_MOST:
        if value[small] > value[large]:
            raise ConfigError(f"{path}: {where} field {small!r} = {value[small]} is larger than "
                              f"{large!r} = {value[large]}")
    for problem in _range_problems(value):
        raise ConfigError(f"{path}: {where} field {problem}")


def _range_problems(value: dict) -> list[str]:
    """What is out of range among the config's values (keyed by config name), each naming its field.

    >>> _range_problems({"n_routed_experts": 384, "n_group": 5, "topk_group": 1, "num_experts_per_tok": 8,
    ...                  "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6, "routed_scaling_factor": 2.8,
    ...                  "scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    ["'n_routed_experts' = 384 is not divisible by 'n_group' = 5 (the grouped top-k splits the experts evenly)"]
    """
    experts, groups = value["n_routed_experts"], value["n_group"]
    problems = []
    if experts % groups:
        problems.append(f"'n_routed_experts' = {experts} is not divisible by 'n_group' = {groups} "
                        "(the grouped top-k splits the experts evenly)")
    elif value["topk_group"] * (experts // groups) < value["num_experts_per_tok"]:
        problems.append(f"'num_experts_per_tok' = {value['num_experts_per_tok']} is more than the "
                        f"{value['topk_group'] * (experts // groups)} experts of 'topk_group' = "
                        f"{value['topk_group']} kept groups")
    if value["qk_rope_head_dim"] % 2:
        problems.append(f"'qk_rope_head_dim' = {value['qk_rope_head_dim']} is odd (rotary embedding turns pairs)")
    if not 0 < value["rms_norm_eps"] < 1:
        problems.append(f"'rms_norm_eps' = {value['rms_norm_eps']!r} lies outside (0, 1)")
    if not value["routed_scaling_factor"] > 0:
        problems.append(f"'routed_scaling_factor' = {value['routed_scaling_factor']!r} is not positive")
    for key, known in (("scoring_func", SCORING_FUNCS), ("topk_method", TOPK_METHODS)):
        if value[key] not in known:
            problems.append(f"{key!r} = {value[key]!r} is not supported ({', '.join(known)})")
    return problems


def _parse_quant(path: Path, quant: dict | None) -> QuantSpec:
    if quant is None:
        return QuantSpec("bf16")
    if not isinstance(quant, dict) or "quant_method" not in quant:
        raise ConfigError(f"{path}: quantization_config lacks 'quant_method'")
    method = quant["quant_method"]
    if method == "compressed-tensors":
        return _parse_compressed_tensors(path, quant)
    if method == "fp8":
        block = quant.get("weight_block_size")
        return QuantSpec("fp8", bits=8, block_size=tuple(block) if block else None)
    raise ConfigError(f"{path}: quant_method {method!r} is not supported (compressed-tensors, fp8 or none)")


def _parse_compressed_tensors(path: Path, quant: dict) -> QuantSpec:
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{path}: quantization_config lacks 'config_groups'")
    weights = next(iter(groups.values())).get("weights")
    if not isinstance(weights, dict):
        raise ConfigError(f"{path}: quantization_config.config_groups has no 'weights' scheme")
    for key in ("num_bits", "group_size"):
        if not isinstance(weights.get(key), int):
            raise ConfigError(f"{path}: quantization_config weights lack integer {key!r}")
    if not 1 <= weights["num_bits"] <= 16:
        raise ConfigError(f"{path}: quantization_config weights 'num_bits' = {weights['num_bits']} lies outside 1..16")
    if weights["group_size"] < 1:
        raise ConfigError(f"{path}: quantization_config weights 'group_size' = {weights['group_size']} is not "
                          "positive (channel-wise scales are not supported)")
    return QuantSpec(
        method="compressed-tensors",
        bits=weights["num_bits"],
        group_size=weights["group_size"],
        symmetric=bool(weights.get("symmetric", True)),
        format=quant.get("format"),
        ignore=tuple(quant.get("ignore", ())),
    )
