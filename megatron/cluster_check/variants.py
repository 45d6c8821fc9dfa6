"""The configs the training sections run, derived from the user's config through the framework's own validation.

Each keeps the user's architecture options (model type, norms, position encoding, Θ, Pattention implementation,
weight tying, initialisation, ZeRO section) and changes what the section needs: a small model that fits any
layout (numerics; throughput on CPU processes), fp32 and deterministic kernels, its own batch sizes, no resume,
no checkpoints unless asked. A change that the user's config makes impossible raises ConfigError, as deepy.py
would.
"""

from __future__ import annotations

import math
from typing import Any

from megatron.config import Config
from megatron.model.spec import layer_pattentions

# Keys the section never takes from the user's run: derived again from the changes, or meaningless here.
_RESET = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": None,
          "precision": None, "lr": None, "padded_vocab_size": None, "lr_decay_iters": None, "load": None,
          "save": None, "pretrain_partial_init": None,
          "eval_only": False, "freeze_old_param_tokens": False, "norm_token_count_ramp_iters": 0,
          "hidden_dropout": 0.0, "attention_dropout": 0.0, "exit_interval": None, "exit_duration_in_mins": None,
          "tensorboard_dir": None, "use_wandb": False, "log_dir": None}


def variant(cfg: Config, **changes: Any) -> Config:
    """`cfg` with `changes`, validated for the same number of processes."""
    values = {**cfg.to_dict(), **_RESET, **changes}
    return Config.from_dict(values, cfg.world_size)


def small_model(cfg: Config, tensor: int, pipe: int) -> dict[str, Any]:
    """A few-million-parameter model of the config's kind that every layout of `tensor` x `pipe` can split: two
    heads per tensor rank of the config's head width (so rotary_pct keeps its even rotary dims), 64 parameter
    tokens per tensor rank for each slot key of the spec's Pattentions (128 for the FFN's), two layers per
    pipeline stage, 64-token sequences."""
    heads = 2 * tensor
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    tokenformer = cfg.model_type == "tokenformer"
    model = {"num_layers": 2 * max(1, pipe), "hidden_size": heads * head_dim, "num_attention_heads": heads,
             "seq_length": 64, "max_position_embeddings": None}
    for spec in layer_pattentions():
        tokens_per_rank = 128 if spec.component == "ffn" else 64
        model[spec.slot_key] = tokens_per_rank * tensor if tokenformer else None
    return model


def fp32(cfg: Config, lr: float) -> dict[str, Any]:
    """fp32, deterministic kernels, and the config's optimizer at learning rate `lr`."""
    optimizer = cfg.optimizer
    optimizer["params"] = {**optimizer.get("params", {}), "lr": lr}
    return {"fp16": None, "bf16": None, "deterministic": True, "optimizer": optimizer}


def batch_split(tensor: int, pipe: int) -> tuple[int, int, int]:
    """(micro-batch, accumulation steps) of a layout with `tensor` x `pipe` model ranks, and the per-rank batch of
    the TP = PP = 1 run on the same processes that sees the same global batch: accumulation covers the pipeline's
    stages (at least 2), and micro-batch x accumulation is a multiple of the model ranks."""
    stages = max(1, pipe)
    model_ranks = tensor * stages
    accumulation = max(2, stages)
    micro = 2 * model_ranks // math.gcd(accumulation, model_ranks)
    return micro, accumulation, micro * accumulation // model_ranks
