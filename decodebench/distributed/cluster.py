"""Where the ranks of a process group run: torchrun-style placement over one or several hosts.

:class:`Cluster` reads the variables torchrun uses (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``NODE_RANK``/``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and gives each local rank its
:class:`RankInfo`; a bad combination is a :class:`ClusterError` that names the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Cluster", "ClusterError", "RankInfo"]


# --- where the ranks run: torchrun-style placement ----------------------------------------


class ClusterError(ValueError):
    """The world size or the torchrun-style environment cannot describe a process group."""


@dataclass(frozen=True)
class RankInfo:
    """One rank's place in the world, as torchrun would describe it to the process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def environ(self) -> dict[str, str]:
        """The variables a torchrun-launched process of this rank would see.

        >>> RankInfo(9, 1, 16, 8, 1, "10.0.0.1", 29500).environ()["RANK"]
        '9'
        """
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


@dataclass(frozen=True)
class Cluster:
    """This host's share of a process group: ``local_world_size`` ranks of ``world_size``.

    Global rank of local rank ``i`` is ``node_rank * local_world_size + i``. On one host the
    rendezvous is 127.0.0.1 on a free port; over several hosts ``master_addr`` and
    ``master_port`` name node 0, where the parent hosts the store.

    >>> Cluster.single_host(2).global_ranks()
    range(0, 2)
    """

    world_size: int
    local_world_size: int
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: node 0 binds a free port (one host only)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1:
            raise ClusterError(f"world size {self.world_size} and local world size "
                               f"{self.local_world_size} must both be at least 1")
        if self.world_size % self.local_world_size:
            raise ClusterError(f"LOCAL_WORLD_SIZE={self.local_world_size} does not divide "
                               f"WORLD_SIZE={self.world_size}: every host must run as many ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ClusterError(f"NODE_RANK={self.node_rank} is outside 0..{self.nnodes - 1} "
                               f"(WORLD_SIZE={self.world_size} / LOCAL_WORLD_SIZE={self.local_world_size})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ClusterError(f"MASTER_PORT={self.master_port} is not a TCP port")
        if self.multi_host and (self.master_port is None or _is_loopback(self.master_addr)):
            raise ClusterError(f"a process group over {self.nnodes} hosts needs MASTER_ADDR (node 0's "
                               f"address, not {self.master_addr!r}) and MASTER_PORT (a free port there)")

    @classmethod
    def single_host(cls, world_size: int) -> Cluster:
        return cls(world_size, world_size)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, world_size: int | None = None,
                 default_world_size: int = 1) -> Cluster:
        """Read ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK`` (or torchrun's
        ``GROUP_RANK``), ``MASTER_ADDR`` and ``MASTER_PORT``.

        ``world_size`` (the ``--world-size`` option) wins over ``WORLD_SIZE`` and must agree
        with it when both are given; ``default_world_size`` applies when neither is.
        Without ``LOCAL_WORLD_SIZE`` every rank runs on this host.

        >>> c = Cluster.from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "NODE_RANK": "1",
        ...                       "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
        >>> c.nnodes, c.global_ranks()
        (2, range(8, 16))
        """
        env = os.environ if environ is None else environ
        _refuse_torchrun_worker(env)
        env_world = _env_int(env, "WORLD_SIZE")
        if world_size is not None and env_world is not None and world_size != env_world:
            raise ClusterError(f"--world-size {world_size} disagrees with WORLD_SIZE={env_world}; drop one")
        world = world_size or env_world or default_world_size
        local = _env_int(env, "LOCAL_WORLD_SIZE") or world
        node = _env_int(env, "NODE_RANK")
        node = _env_int(env, "GROUP_RANK") if node is None else node
        return cls(world, local, node or 0, env.get("MASTER_ADDR") or "127.0.0.1", _env_int(env, "MASTER_PORT"))

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def multi_host(self) -> bool:
        return self.nnodes > 1

    def global_ranks(self) -> range:
        first = self.node_rank * self.local_world_size
        return range(first, first + self.local_world_size)

    def local_ranks(self, master_port: int) -> list[RankInfo]:
        """The :class:`RankInfo` of every rank this host runs, given the store's port."""
        return [RankInfo(rank, local, self.world_size, self.local_world_size, self.node_rank,
                         self.master_addr, master_port)
                for local, rank in enumerate(self.global_ranks())]


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ClusterError(f"{name}={text!r} is not an integer") from None


def _refuse_torchrun_worker(env: Mapping[str, str]) -> None:
    # Under torchrun every pytest would be one rank *and* spawn ranks of its own; torchrun's
    # agent also already holds MASTER_PORT. Say what to do instead of half-working.
    for name in ("RANK", "LOCAL_RANK"):
        if name in env:
            raise ClusterError(
                f"{name}={env[name]} is set: decodebench starts one process per rank itself, so run one "
                "pytest per host (not under torchrun) with WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, "
                f"MASTER_ADDR and MASTER_PORT, and unset {name} (docs/multigpu.md)")
