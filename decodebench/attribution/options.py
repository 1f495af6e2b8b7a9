"""The prediction's options, declared once: the pytest fixtures (``--breakdown``) and every offline
command (``python -m decodebench breakdown | scenarios``) add them from here, as the gate's options
come from :mod:`decodebench.gate.settings` (pytest's ``addoption`` and argparse's ``add_argument``
take the same arguments).

A command adds the options it takes, by name; where its default differs (the context of a step
predicted from results alone), it passes its own with the words that say it. After parsing,
:func:`check_deployment` refuses a TP or a depth the model cannot have, naming the value.

Example::

    parser = argparse.ArgumentParser()
    add_prediction_options(parser.add_argument, ("what_if", "project_to", "server_layers"))
    args = parser.parse_args(["--what-if", "allreduce=0.5x"])
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ShapeError
from ..model import ModelSpec, load_model_spec
from ..options import choice, positive_int
from ..serving.server_routing import ServerRouting
from ..shapes import DecodeShapes
from ..timing import TimerMode
from .predict.step import WhatIfError
from .predict.targets import Target, load_target, shipped_targets
from .predict.whatif import parse_what_if, what_if_syntax

__all__ = ["OPTIONS", "add_prediction_options", "check_context", "check_deployment", "check_layers",
           "model_option", "results_file", "target_option", "timer_option", "what_if_option"]


def model_option(text: str) -> ModelSpec:
    """argparse type of ``--model``: a bundled name or a config.json / model directory.

    >>> model_option("tiny-kimi").name
    'tiny-kimi'
    """
    try:
        return load_model_spec(text)
    except Exception as exc:  # noqa: BLE001 - any unreadable config is a usage error naming it
        raise argparse.ArgumentTypeError(f"--model {text!r}: {exc}") from None


def results_file(text: str) -> Path:
    """argparse type of a stored result file: it must exist.

    >>> results_file("no/such/file.json")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 'no/such/file.json': no such file
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a result file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return path


def what_if_option(text: str):
    """argparse type of ``--what-if``: every kind through :func:`~.predict.whatif.parse_what_if`.

    >>> what_if_option("allreduce=0.5x").label, what_if_option("spec=ngram:4:0.6").label
    ('allreduce=0.5x', 'spec=ngram:4:0.6')
    """
    try:
        return parse_what_if(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def target_option(text: str) -> Target:
    """argparse type of ``--project-to``: a shipped target id or a target file.

    >>> target_option("h200-x8-nvlink").tp
    8
    """
    try:
        return load_target(text)
    except WhatIfError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# argparse type of ``--prefer-timer``: one of the timer modes (the MLA cases are measured with two)
timer_option = choice("timer", tuple(m.value for m in TimerMode))


@dataclass(frozen=True)
class Option:
    """One option: its flag, what it says, and its default with the words that name it."""

    flag: str
    help: str
    default: object = None
    default_text: str = "none"
    kwargs: dict = field(default_factory=dict)


OPTIONS = {o.flag[2:].replace("-", "_"): o for o in (
    Option("--model", "The model of the kernel results and the served model, at its full depth: a bundled name or "
           "a config.json / model directory.", None, "the results' machine_info",
           {"metavar": "NAME|PATH", "type": model_option}),
    Option("--tp", "The tensor-parallel size of the kernel results' per-rank shapes (the server's).", None,
           "the results' machine_info", {"metavar": "N", "type": positive_int}),
    Option("--server-layers", "Decoder layers the server runs (num_hidden_layers = N), so one layer's real shapes "
           "fit on few GPUs; the breakdown also estimates the full depth.", None, "the model's own depth",
           {"metavar": "N", "type": positive_int}),
    Option("--server-rank-of", "Serve one rank of TP N on one GPU: the config with the attention heads, the experts' "
           "width, the dense MLP and the vocabulary divided by N (--hf-overrides), the replicated parts whole, at TP "
           "1. Every per-rank shape is checked against the kernel benchmarks' --tp N before the server starts; the "
           "breakdown then predicts at TP N and names the all-reduces the profile lacks.", None, "off",
           {"metavar": "N", "type": positive_int}),
    Option("--predict-from", "pytest-benchmark JSON of kernel results (same model, TP, device) to predict the step "
           "from; repeatable.", [], "none (no prediction)",
           {"metavar": "FILE", "type": results_file, "action": "append"}),
    Option("--prefer-timer", "Of two kernel results of one point measured with different timers (the MLA cases "
           "with --timer kernel and --timer cold), predict from this timer's.", None,
           "the first given, which the prediction names as an assumption", {"metavar": "MODE", "type": timer_option}),
    Option("--context", "The decode context length (tokens) the MLA term is predicted at.", None,
           "the live run's (from the window manifest), else none: MLA not predicted",
           {"metavar": "TOKENS", "type": positive_int}),
    Option("--server-routing", "How the server routes its MoE layers: model (as its weights do), uniform or skewed "
           "(the MoE benchmark's distributions, through vLLM's routing simulator; skewed through decodebench's vLLM "
           "plugin).", None,
           "the live run's (recorded in the manifest), else unknown (the prediction assumes uniform and says so)",
           {"metavar": "MODE", "type": choice("server routing", tuple(r.value for r in ServerRouting))}),
    Option("--what-if", "The step predicted with a change, one scenario per option (repeatable; comma-joined "
           f"changes make one scenario): {what_if_syntax()}.", [], "none (today and Amdahl's bounds only)",
           {"metavar": "COMPONENT=VALUE", "type": what_if_option, "action": "append"}),
    Option("--project-to", "The step projected to another machine from this one's kernel results: a shipped target "
           f"({', '.join(shipped_targets())}) or a target JSON file; repeatable.", [], "none",
           {"metavar": "TARGET", "type": target_option, "action": "append"}),
)}


def add_prediction_options(add: Callable[..., object], names: Iterable[str] = tuple(OPTIONS),
                           defaults: dict[str, tuple[object, str]] | None = None) -> None:
    """Declare the options ``names`` (keys of :data:`OPTIONS`) through ``add``; ``defaults`` gives a
    command's own default of an option and the words that name it.

    >>> p = argparse.ArgumentParser()
    >>> add_prediction_options(p.add_argument, ("server_layers", "context"), {"context": (1024, "1024")})
    >>> p.parse_args(["--server-layers", "4"])
    Namespace(server_layers=4, context=1024)
    """
    for name in names:
        option = OPTIONS[name]
        default, text = (defaults or {}).get(name, (option.default, option.default_text))
        default = list(default) if isinstance(default, list) else default  # append must not grow the shared list
        add(option.flag, default=default, help=f"{option.help} Default: {text}".replace("%", "%%"), **option.kwargs)


def check_deployment(spec: ModelSpec, tp: int, layers: int | None = None, flag: str = "--tp") -> None:
    """Refuse, naming the value (and ``flag``, the option that gave the TP), a TP whose per-rank shapes the
    model cannot have and a depth beyond the model's (or one that serves none of its MoE layers).

    >>> check_deployment(load_model_spec("kimi-k2.5"), 3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    decodebench.attribution.predict.step.WhatIfError: --tp 3: ...
    >>> check_deployment(load_model_spec("kimi-k2.5"), 8, 1000)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    decodebench.attribution.predict.step.WhatIfError: --server-layers 1000: kimi-k2.5 has 61 decoder layers; ...
    """
    try:
        DecodeShapes.for_deployment(spec, tp)
    except (ShapeError, ValueError) as exc:
        raise WhatIfError(f"{flag} {tp}: {exc}") from None
    if layers is not None:
        check_layers(spec, layers)


def check_context(spec: ModelSpec, context: int | None) -> None:
    """Refuse a decode context longer than the model's positions (``max_position_embeddings``), naming both.

    >>> check_context(load_model_spec("kimi-k2.5"), 300000)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    decodebench.attribution.predict.step.WhatIfError: --context 300000: kimi-k2.5 takes at most 262144 positions ...
    """
    if context is not None and spec.max_positions is not None and context > spec.max_positions:
        raise WhatIfError(f"--context {context}: {spec.name} takes at most {spec.max_positions} positions "
                          "(max_position_embeddings)")


def check_layers(spec: ModelSpec, layers: int) -> None:
    """Refuse a depth beyond the model's, or one that serves none of its MoE layers, naming the range.

    >>> check_layers(load_model_spec("tiny-kimi"), 1)
    Traceback (most recent call last):
    ...
    decodebench.attribution.predict.step.WhatIfError: --server-layers 1: tiny-kimi has 2 decoder layers; give 2..2 \
(its first 1 are dense: at least one MoE layer must run)
    """
    if not spec.first_dense_layers < layers <= spec.num_layers:
        raise WhatIfError(f"--server-layers {layers}: {spec.name} has {spec.num_layers} decoder layers; give "
                          f"{spec.first_dense_layers + 1}..{spec.num_layers} (its first {spec.first_dense_layers} "
                          "are dense: at least one MoE layer must run)")
