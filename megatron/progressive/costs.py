"""What each stage of a plan costs, from its config alone: parameters, training FLOPs (megatron/model/flops.py,
the formula the training log uses) and how much of them Pattention is, the part growth scales."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import Config
from megatron.growth.plan import padded_vocabulary
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model.flops import pattention_share
from megatron.model.parameter_count import count_parameters_by_component


@dataclass(frozen=True)
class StageCost:
    parameters: int
    pattention_parameters: int
    flops_per_token: int  # training: forward + backward (+ recompute with activation checkpointing)
    pattention_share: float  # of the forward FLOPs
    tokens_per_step: int
    steps: int

    @property
    def flops_per_step(self) -> float:
        return float(self.flops_per_token * self.tokens_per_step)

    @property
    def training_flops(self) -> float:
        return self.flops_per_step * self.steps


def model_args(cfg: Config) -> TokenFormerArgs:
    """The model's arguments with the vocabulary padded as the run pads it."""
    return TokenFormerArgs.from_config(cfg, padded_vocab_size=padded_vocabulary(cfg))


def parameter_counts(args: TokenFormerArgs) -> dict[str, int]:
    """count_parameters_by_component of the model `args` describe, built on the meta device (nothing allocated)."""
    return count_parameters_by_component(TokenFormerModel(args, device="meta"))


def stage_cost(cfg: Config, steps: int | None = None) -> StageCost:
    """The stage's size and compute over `steps` (its train_iters where not given: a stage of a chain)."""
    args = model_args(cfg)
    counts = parameter_counts(args)
    return StageCost(counts["total_params"], counts["attention"] + counts["ffn"],
                     flops_per_token(args, include_recompute=cfg.checkpoint_activations), pattention_share(args),
                     cfg.train_batch_size * cfg.seq_length, cfg.train_iters if steps is None else steps)


def schedule(cfg: Config) -> str:
    """'warmup 20, cosine to 3e-04 at 400, peak 3e-03'."""
    decay = cfg.lr_decay_iters
    return f"warmup {int(cfg.warmup * decay)}, {cfg.lr_decay_style} to {cfg.min_lr:.0e} at {decay}, peak {cfg.lr:.0e}"


def layout(cfg: Config) -> str:
    """'2 processes (tp 1, pp 1, dp 2)'."""
    model = cfg.model_parallel_size * max(1, cfg.pipe_parallel_size)
    return (f"{cfg.world_size} processes (tp {cfg.model_parallel_size}, pp {cfg.pipe_parallel_size}, "
            f"dp {cfg.world_size // model})")


def flops(value: float) -> str:
    """FLOPs with a unit a person reads: '24.16 TFLOP'."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} FLOP"
