"""`growth_schedule`: the iterations at which a running job grows its parameter tokens (docs/growth.md).

    growth_schedule:
      - {iteration: 2000, qkv_slot_num: 512, proj_slot_num: 512, ffn_slot_num: 2048}
      - {iteration: 4000, ffn_slot_num: 4096}

An entry's slot counts hold from the iteration after it; a count it leaves out stays as it was. The config's
own slot counts are the model the run starts with. A checkpoint is saved at each listed iteration, before the
growth (the record of the smaller model; resuming it grows again), and every later one holds the grown model,
so a resume builds the model of the entries before its iteration (GrowthSchedule.config_at).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron.config import Config
from megatron.config.growth_schedule import KEY, counts_after_each


@dataclass(frozen=True)
class ScheduledGrowth:
    iteration: int
    counts: dict[str, int]  # every slot key's count from the next iteration on


@dataclass(frozen=True)
class GrowthSchedule:
    """A validated config's schedule: `config`, the run's own (its slot counts are the model it starts with), and
    each growth with every count it leaves in effect, in order."""

    config: Config
    growths: tuple[ScheduledGrowth, ...]

    @classmethod
    def from_config(cls, config: Config) -> GrowthSchedule:
        entries, counts = config.growth_schedule or (), counts_after_each(config)[1:]
        return cls(config, tuple(ScheduledGrowth(entry["iteration"], after) for entry, after in zip(entries, counts)))

    def config_at(self, iteration: int) -> Config:
        """The config of the model a checkpoint at `iteration` holds: every growth listed before it applied (one
        listed at `iteration` comes after that checkpoint, which holds the model before it), and the growths
        still to come as its schedule. Its checkpoints' config.json describes their model, and validates."""
        done = [growth for growth in self.growths if growth.iteration < iteration]
        if not done:
            return self.config
        entries = [entry for entry in self.config.growth_schedule if entry["iteration"] >= iteration]
        return Config.from_dict({**self.config.to_dict(), **done[-1].counts, KEY: entries or None})

    def at(self, iteration: int) -> ScheduledGrowth | None:
        return next((growth for growth in self.growths if growth.iteration == iteration), None)


def config_for_checkpoint(cfg: Config, tag: str | None) -> Config:
    """The config a run of `cfg` resumes checkpoint `tag` (global_stepN, or a re-sharded copy) with: `cfg` where it
    has no schedule or starts afresh, else the model grown as listed before N (GrowthSchedule.config_at)."""
    step = re.match(r"global_step(\d+)", tag or "")
    if not cfg.growth_schedule or step is None:
        return cfg
    return GrowthSchedule.from_config(cfg).config_at(int(step.group(1)))
