"""How a started server routes its MoE layers (``--server-routing``), and the plugin that sees to it.

``model`` routes as the weights do; ``uniform`` and ``skewed`` are the MoE benchmark's own
distributions, through vLLM's routing simulator and decodebench's vLLM plugin
(:mod:`decodebench.serving.vllm_plugin`). Nothing is installed: :func:`plugin_dir` declares the
plugin's entry point in a ``*.dist-info`` of the session's own, and :func:`server_env` puts it
and this checkout first on the server's ``PYTHONPATH`` (docs/attribution.md, "The server's
routing"); a server started without these variables loads nothing of ours.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from enum import Enum
from pathlib import Path

from ..errors import ServerError
from .vllm_plugin import (
    CAPTURE_ENV,
    ENTRY_POINT,
    LOG_PREFIX,
    PLUGIN_NAME,
    SERVER_ROUTING_ENV,
    SIMULATOR_ENV,
    SIMULATOR_MODULES,
    SKEWED_STRATEGY,
    UNIFORM_STRATEGY,
)

__all__ = ["DIST_INFO", "ServerRouting", "check_simulator", "default_routing", "plugin_dir", "routing_record",
           "server_env"]

DIST_INFO = "decodebench_vllm_plugin-0.dist-info"
CHECKOUT = Path(__file__).resolve().parents[2]  # the directory holding the decodebench package
_SIMULATING = re.compile(r"Simulating MoE routing using a (\S+) strategy")


class ServerRouting(str, Enum):
    MODEL = "model"
    UNIFORM = "uniform"
    SKEWED = "skewed"

    @property
    def strategy(self) -> str | None:
        """The routing simulator strategy that routes this way (None: the model's own router)."""
        return {ServerRouting.UNIFORM: UNIFORM_STRATEGY, ServerRouting.SKEWED: SKEWED_STRATEGY}.get(self)


def default_routing(load_format: str) -> ServerRouting:
    """``uniform`` with dummy weights (their own routing describes no real model), else ``model``.

    >>> default_routing("dummy").value, default_routing("auto").value
    ('uniform', 'model')
    """
    return ServerRouting.UNIFORM if load_format == "dummy" else ServerRouting.MODEL


def plugin_dir(directory: Path) -> Path:
    """``directory`` with decodebench's vLLM plugin declared in it (a ``*.dist-info``); returns ``directory``.

    >>> import tempfile
    >>> d = plugin_dir(Path(tempfile.mkdtemp()))
    >>> (d / DIST_INFO / "entry_points.txt").read_text().splitlines()[0]
    '[vllm.general_plugins]'
    """
    info = Path(directory) / DIST_INFO
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: decodebench-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return Path(directory)


def server_env(routing: ServerRouting, *, plugins: Path | None, capture_dir: Path | None = None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables for a server that routes as ``routing`` (and captures into ``capture_dir``).

    ``plugins`` is a :func:`plugin_dir` (needed unless the model routes and nothing is captured).

    >>> env = server_env(ServerRouting.UNIFORM, plugins=Path("/p"), base={"PYTHONPATH": "/x"})
    >>> env["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"], env["PYTHONPATH"].split(":")[0]
    ('decodebench_uniform', '/p')
    >>> server_env(ServerRouting.MODEL, plugins=None)
    {}
    """
    base = os.environ if base is None else base
    if routing is ServerRouting.MODEL and capture_dir is None:
        return {}
    if plugins is None:
        raise ValueError("decodebench's vLLM plugin is needed: pass plugins=plugin_dir(...)")
    env = {SERVER_ROUTING_ENV: routing.value,
           "PYTHONPATH": os.pathsep.join(p for p in (str(plugins), str(CHECKOUT), base.get("PYTHONPATH")) if p)}
    if routing.strategy:
        env[SIMULATOR_ENV] = routing.strategy
    if capture_dir is not None:
        env[CAPTURE_ENV] = str(capture_dir)
    if base.get("VLLM_PLUGINS") is not None:  # an allow-list: ours must be on it
        env["VLLM_PLUGINS"] = ",".join(p for p in (base["VLLM_PLUGINS"], PLUGIN_NAME) if p)
    return env


def check_simulator(routing: ServerRouting) -> str | None:
    """The routing simulator module this interpreter's vLLM has; a :class:`ServerError` naming the option
    when it has none. Looks for the file without importing vLLM. Nothing to check for ``model``.

    A server run by another interpreter (``--server-python``) is checked by the plugin inside it,
    which stops the server with the same message.
    """
    if routing is ServerRouting.MODEL:
        return None
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(f"--server-routing {routing.value}: no vLLM is installed for {sys.executable}")
    root = Path(list(spec.submodule_search_locations)[0]).parent
    for module in SIMULATOR_MODULES:
        if (root / (module.replace(".", "/") + ".py")).is_file():
            return module
    raise ServerError(f"--server-routing {routing.value}: the vLLM at {root / 'vllm'} has no MoE routing simulator "
                      f"({' or '.join(SIMULATOR_MODULES)}), so {SIMULATOR_ENV} would be ignored; use "
                      "--server-routing model or a vLLM that has it")


def routing_record(routing: ServerRouting | None, log_path: Path | None = None) -> dict:
    """What a stored result says of the server's routing: the mode, the simulator strategy, and the
    strategy vLLM's log says it simulated (``None`` when the log says none).

    >>> routing_record(ServerRouting.MODEL)
    {'mode': 'model', 'strategy': None}
    """
    record: dict = {"mode": routing.value if routing else "unknown", "strategy": routing.strategy if routing else None}
    if log_path is not None and routing is not None:
        try:
            log = Path(log_path).read_text(errors="replace")
        except OSError:
            log = ""
        match = _SIMULATING.search(log)
        record["simulated_per_log"] = match.group(1) if match else None
        record["plugin_per_log"] = LOG_PREFIX in log
    return record
