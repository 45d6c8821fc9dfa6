"""Where every rank runs, known to every rank, and how a finding names ranks and hosts.

The check gathers each rank's observations to every rank (all_gather_object) and lets global rank 0 judge them;
naming "rank 5 on node-b" rather than "rank 5" is what lets a reader of the report walk to the right machine.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

NAMED_AT_MOST = 6  # ranks listed by name in one finding; the rest are counted


def gather(value: Any) -> list[Any]:
    """Every rank's `value` (any picklable object), in rank order, on every rank."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@dataclass(frozen=True)
class Ranks:
    """The host of every rank, in rank order."""

    hosts_by_rank: tuple[str, ...]

    @classmethod
    def gather(cls) -> Ranks:
        return cls(tuple(gather(socket.gethostname())))

    @property
    def world_size(self) -> int:
        return len(self.hosts_by_rank)

    def hosts(self) -> list[str]:
        """The hosts, in the order of their first rank."""
        return list(dict.fromkeys(self.hosts_by_rank))

    def on_host(self, host: str) -> list[int]:
        return [rank for rank, h in enumerate(self.hosts_by_rank) if h == host]

    def local_rank(self, rank: int) -> int:
        """The rank's place among the ranks of its host."""
        return self.on_host(self.hosts_by_rank[rank]).index(rank)

    def who(self, rank: int) -> str:
        return f"rank {rank} on {self.hosts_by_rank[rank]}"

    def name(self, ranks: list[int]) -> str:
        """"rank 3 on node-b", or "ranks 1, 3 on node-b; rank 4 on node-c", the first NAMED_AT_MOST of them."""
        shown, rest = sorted(ranks)[:NAMED_AT_MOST], len(ranks) - NAMED_AT_MOST
        by_host: dict[str, list[int]] = {}
        for rank in shown:
            by_host.setdefault(self.hosts_by_rank[rank], []).append(rank)
        parts = [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} on {host}" for host, rs in by_host.items()]
        return "; ".join(parts) + (f" and {rest} more" if rest > 0 else "")
