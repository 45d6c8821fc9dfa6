"""Growth inside the running job, at the iterations growth_schedule lists (growth/schedule.py, docs/growth.md).

At a listed iteration the trainer has just saved the model before growth (checkpoint/save.py should_save). Every
rank reads its part of that checkpoint back and grows it with the code tools/grow_checkpoint.py and
pretrain_partial_init use (growth/grow.py, through partial_init.grow_into) into an engine built at the new counts:
the numbers a save, the grow tool and a resume give, without leaving the job or its data loader. The trainer
sets its random generators back to their state before the rebuild (a model's construction draws its init from
them) and goes on with the same iteration, data position and LR schedule.

Reading the checkpoint back, rather than gathering the live shards, keeps one growth code path for the three
entry points; the read mostly hits the page cache the save just filled.
"""

from __future__ import annotations

from pathlib import Path

from megatron.checkpoint.manifest import content_digest
from megatron.growth.plan import GrowthPlan
from megatron.model.spec import slot_keys


def online_growth_record(plan: GrowthPlan, previous: dict | None, source_dir: Path, norms: dict[str, int],
                         iteration: int) -> dict:
    """The growth.json the grown model's checkpoints carry: what the grow tool writes for the same growth."""
    record = plan.growth_record(previous) or {}
    return {**record, "source_sha256": content_digest(source_dir), "norm_token_count": norms,
            "iteration": iteration}


def growth_line(iteration: int, plan: GrowthPlan, seconds: float) -> str:
    """e.g. 'grew at iteration 2000: qkv 256→512, proj 256→512, ffn 1024→2048 (preserve, Adam carried) in 3.1 s'"""
    counts = ", ".join(f"{key.removesuffix('_slot_num')} {plan.old_tokens[key]}→{plan.new_tokens[key]}"
                       for key in slot_keys())
    how = [plan.mode, "Adam reset" if plan.resets_optimizer else "Adam carried"]
    if plan.norm == "new":
        how.append("√n of the new count")
    return f"grew at iteration {iteration}: {counts} ({', '.join(how)}) in {seconds:.1f} s"


def growth_metrics(iteration: int, plan: GrowthPlan, seconds: float) -> dict:
    """metrics.jsonl's record of a growth (split "growth")."""
    return {"iteration": iteration, "split": "growth", "slot_counts_before": dict(plan.old_tokens),
            "slot_counts": dict(plan.new_tokens), "growth_mode": plan.mode, "growth_optimizer": plan.optimizer,
            "growth_norm_token_count": plan.norm, "seconds": seconds}
