"""``python -m decodebench VERB ...`` (installed: ``decodebench VERB ...``): every offline command.

Each verb is a function of files on disk that prints what the live session prints; ``VERB --help``
gives its options. The pytest plugin runs the measurements; these read what it stored.
``ci/decodebench VERB ...`` runs a verb in the suite's environment (``ci/env.sh``); any Python
gives ``--help``, and a verb that needs a library the interpreter lacks says so in one line,
naming it and that command (exit 2).

Example::

    python -m decodebench gate baselines/<fingerprint> .benchmarks/current.json --gate 5%
    python -m decodebench scenarios baselines/<fingerprint>/0002_x.json --model kimi-k2.5 --tp 8
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["VERBS", "main", "missing_library"]

# verb -> (module:function taking argv and returning the exit status, what it does)
VERBS = {
    "gate": ("decodebench.gate.offline:main", "judge a current result against the stored ones (the offline gate)"),
    "breakdown": ("decodebench.attribution.cli:breakdown", "break down profiler traces on disk into components, "
                                                            "with the prediction from kernel results"),
    "scenarios": ("decodebench.attribution.cli:scenarios", "predict decode steps from stored kernel results: "
                                                            "what-ifs, Amdahl's bounds, projections"),
    "steps": ("decodebench.attribution.cli:steps", "where an engine step's wall time goes: GPU busy against host "
                                                    "time, from profiler traces"),
    "fit": ("decodebench.attribution.predict.rule_file:main", "fit the projection rule on one GPU's stored results "
                                                               "and store it beside them (rule-<gpu>.json)"),
    "history": ("decodebench.history:main", "plot every benchmark across the stored results of one fingerprint"),
    "kernel-rules": ("decodebench.kernel_rules:main", "check the kernel-name rules against stored kernel results"),
}


def usage() -> str:
    """The verbs, one line each.

    >>> print(usage().splitlines()[0])
    usage: python -m decodebench VERB [ARGS...]   (VERB --help for its options)
    """
    width = max(map(len, VERBS))
    return "\n".join(["usage: python -m decodebench VERB [ARGS...]   (VERB --help for its options)", "verbs:",
                      *(f"  {verb:<{width}}  {why}" for verb, (_, why) in VERBS.items())])


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``argv[0]``'s command on the rest; 2 with the verbs listed when it names none.

    >>> main(["no-such-verb"])
    Traceback (most recent call last):
    ...
    SystemExit: 2
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] not in VERBS:
        print(f"python -m decodebench: unknown verb {args[0]!r}\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module, _, function = VERBS[args[0]][0].partition(":")
    try:
        return getattr(importlib.import_module(module), function)(args[1:])
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "decodebench":
            raise
        print(missing_library(args[0], missing), file=sys.stderr)
        return 2


def missing_library(verb: str, module: str) -> str:
    """The one line for a verb whose interpreter lacks ``module``.

    >>> print(missing_library("history", "pygal"))  # doctest: +ELLIPSIS
    python -m decodebench history: needs the Python module 'pygal', which ... does not have; run it in the \
suite's environment: ci/decodebench history ... (ci/env.sh sets it up, as ci/bench and ci/test do)
    """
    return (f"python -m decodebench {verb}: needs the Python module {module!r}, which {sys.executable} does not "
            f"have; run it in the suite's environment: ci/decodebench {verb} ... (ci/env.sh sets it up, as "
            "ci/bench and ci/test do)")


if __name__ == "__main__":
    sys.exit(main())
