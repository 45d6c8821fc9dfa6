"""What every section of the cluster check is given: the user's config, where the ranks run, this rank's device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.cluster_check.ranks import Ranks
from megatron.config import Config


@dataclass(frozen=True)
class CheckContext:
    cfg: Config
    ranks: Ranks
    device: torch.device
    tag: str  # this launch's, in the names of the files the check writes

    @property
    def on_cpu(self) -> bool:
        """CPU processes: sizes shrink so that the check finishes in minutes, and the ranks share the host's
        cores, so per-rank timings are taken one rank at a time."""
        return self.device.type == "cpu"
