"""One rank of a TP-N deployment as a model of its own, served at TP 1 on one GPU.

A rank of Kimi-K2.5 at TP 8 runs 1/8 of the attention heads, of every expert's width, of the dense
MLP and of the vocabulary, and the replicated parts whole (q_a and kv_a, the router, the norms).
Served at TP 1 with those fields divided, one GPU runs the very kernels one rank of the TP-8
deployment runs, at the same per-rank shapes, less the collectives (a TP-1 server runs none).
``--server-rank-of N`` serves that config; :func:`shape_differences` checks, before the server
starts, that every per-rank shape it will run equals ``DecodeShapes(tp=N)`` of the model.
"""

from __future__ import annotations

from pathlib import Path

from .model import ModelSpec, load_model_spec, read_config, resolve_model_path, spec_from_config  # noqa: F401 (doctests)
from .shapes import DecodeShapes

__all__ = ["collectives_note", "rank_fields", "served_rank_spec", "shape_differences"]

# config.json field -> the ModelSpec attribute it sets: what TP splits
_SPLIT = {"num_attention_heads": "num_heads", "moe_intermediate_size": "moe_intermediate_size",
          "intermediate_size": "dense_intermediate_size", "vocab_size": "vocab_size"}


def rank_fields(spec: ModelSpec, tp: int) -> dict[str, int]:
    """The config fields one rank of TP ``tp`` holds a share of, at that share.

    Raises :class:`~decodebench.errors.ShapeError` where ``tp`` does not divide the model.

    >>> rank_fields(load_model_spec("kimi-k2.5"), 8)
    {'num_attention_heads': 8, 'moe_intermediate_size': 256, 'intermediate_size': 2304, 'vocab_size': 20480}
    """
    DecodeShapes.for_deployment(spec, tp)  # every split divides, or a ShapeError naming the field
    return {field: getattr(spec, attr) // tp for field, attr in _SPLIT.items()}


def served_rank_spec(model: str | Path, overrides: dict) -> ModelSpec:
    """The ModelSpec of ``model``'s config.json with ``overrides`` (what ``--hf-overrides`` sets, nested in
    ``text_config`` where the config nests it), parsed by the same reader as every config.

    >>> served_rank_spec("kimi-k2.5", {"text_config": {"num_attention_heads": 8}}).num_heads
    8
    """
    path = resolve_model_path(model)
    return spec_from_config(path, _merged(read_config(path), overrides))


def shape_differences(spec: ModelSpec, tp: int, served: ModelSpec) -> list[str]:
    """Every per-rank shape where ``served`` at TP 1 differs from ``spec`` at TP ``tp`` ([] when they agree);
    the depth may differ (``--server-layers``), and the collectives do by design (:func:`collectives_note`).

    >>> kimi = load_model_spec("kimi-k2.5")
    >>> one = served_rank_spec("kimi-k2.5", {"text_config": rank_fields(kimi, 8)})
    >>> shape_differences(kimi, 8, one)
    []
    >>> shape_differences(kimi, 8, served_rank_spec("kimi-k2.5", {"text_config": {"num_attention_heads": 16}}))[0]
    'MLA heads: 16 served, 8 at TP 8'
    """
    rank, whole = DecodeShapes.for_deployment(served, 1), DecodeShapes.for_deployment(spec, tp)
    pairs = {
        "MLA heads": (rank.mla.heads, whole.mla.heads),
        "MLA latent and rope widths": ((rank.mla.kv_lora_rank, rank.mla.rope_dim, rank.mla.nope_dim,
                                        rank.mla.v_head_dim), (whole.mla.kv_lora_rank, whole.mla.rope_dim,
                                                               whole.mla.nope_dim, whole.mla.v_head_dim)),
        "MoE gate_up": (rank.moe_gate_up, whole.moe_gate_up),
        "MoE down": (rank.moe_down, whole.moe_down),
        "router GEMM": (rank.router, whole.router),
        "experts and top-k": ((rank.experts, rank.top_k), (whole.experts, whole.top_k)),
        "RMSNorm widths": (rank.norm_widths, whole.norm_widths),
        "quantization": (served.quant, spec.quant),
    }
    out = [f"{name}: {mine} served, {theirs} at TP {tp}" for name, (mine, theirs) in pairs.items() if mine != theirs]
    gemms = {g.op: (g.n, g.k, g.batch) for g in rank.dense_gemms}
    for g in whole.dense_gemms:
        if gemms.get(g.op) != (g.n, g.k, g.batch):
            out.append(f"dense GEMM {g.op}: {gemms.get(g.op)} served (n, k, batch), {(g.n, g.k, g.batch)} at TP {tp}")
    return out


def collectives_note(spec: ModelSpec, tp: int) -> str:
    """What a one-rank server leaves out: the TP all-reduces of a step (named, never counted as zero).

    >>> collectives_note(load_model_spec("tiny-kimi"), 2)
    'one rank of TP 2 served at TP 1 runs no collective: the 5 all-reduces of a TP-2 step are not in this profile'
    """
    calls = DecodeShapes.for_deployment(spec, tp).allreduces_per_step
    return (f"one rank of TP {tp} served at TP 1 runs no collective: the {calls} all-reduces of a TP-{tp} step "
            "are not in this profile")


def _merged(config: dict, overrides: dict) -> dict:
    out = dict(config)
    for key, value in overrides.items():
        out[key] = _merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out
