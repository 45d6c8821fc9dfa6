"""The optimizer and the DeepSpeed configuration derived from our config.

AdamW with decoupled weight decay on every matrix (parameter tokens and
embeddings) and none on norms and biases. GPT-NeoX's "Adam" type with a weight
decay is AdamW too (its FusedAdam runs in adam_w_mode), so both names map here.
We build the torch optimizer ourselves rather than letting DeepSpeed pick a
fused CUDA one, so the same code runs on CPU (gloo) and on GPUs (NCCL).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.training.gradient_clipping import clips_in_optimizer

_FUSED_ADAMW_DEVICES = ("cuda", "cpu", "xpu", "mps")


def has_fused_adamw(device_type: str) -> bool:
    """Whether torch has a fused AdamW kernel for `device_type` (none on hpu, npu, mlu, ...): the lean step
    needs it, to skip a non-finite update on the device."""
    return device_type in _FUSED_ADAMW_DEVICES


def parameter_groups(model: torch.nn.Module, weight_decay: float, two_groups: bool = False) -> list[dict[str, Any]]:
    """Split parameters into a decayed group (matrices) and a non-decayed one (1-D).

    `two_groups`: always exactly two groups, as a stage of a multi-stage pipeline needs. DeepSpeed's ZeRO
    optimizer all-reduces the gradient norm over every stage once per group, so all stages must have as
    many groups, yet some stages have no 1-D parameters (TokenFormer's layer norms have none): there one
    parameter of the other group gets a group of its own, with that group's weight decay.
    """
    decay, no_decay = [], []
    for _, param in sorted(model.named_parameters()):
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if two_groups and not (decay and no_decay):
        full, empty = (groups[0], groups[1]) if decay else (groups[1], groups[0])
        if len(full["params"]) < 2:
            raise ValueError("a pipeline stage holds fewer than two parameters; choose a pipe_partition_method "
                             "or pipe_parallel_size that gives every stage a TokenFormer layer")
        empty.update(params=[full["params"].pop()], weight_decay=full["weight_decay"])
    return [group for group in groups if group["params"]]


def build_optimizer(model: torch.nn.Module, cfg, device_type: str) -> torch.optim.Optimizer:
    params = (cfg.optimizer or {}).get("params", {})
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay, two_groups=cfg.pipe_parallel_size > 1),
        lr=cfg.lr,
        betas=tuple(params.get("betas", (0.9, 0.999))),
        eps=params.get("eps", 1e-8),
        # torch's fused AdamW kernel (one pass over all tensors) where it exists.
        fused=True if has_fused_adamw(device_type) else None,
    )


def deepspeed_config(cfg) -> dict[str, Any]:
    """The DeepSpeed engine's config: batch sizes, clipping, ZeRO and precision."""
    ds: dict[str, Any] = {
        "train_batch_size": cfg.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        # With ZeRO stage 0 in fp32 our optimizer's pre-step hook clips (gradient_clipping.py).
        "gradient_clipping": 0.0 if clips_in_optimizer(cfg) else cfg.gradient_clipping,
        "zero_optimization": dict(cfg.zero_optimization or {"stage": 0}),
        # We log ourselves every log_interval; keep DeepSpeed's own prints rare.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronizes the device when each micro-batch's forward starts and when
        # the optimizer steps (two host waits a step, its default) for a rate it prints every steps_per_print;
        # our log measures throughput without them.
        "timers": {"throughput": {"enabled": False}},
        # Our optimizer is plain torch AdamW, which ZeRO partitions correctly.
        "zero_allow_untested_optimizer": True,
    }
    if cfg.precision == "fp16":
        ds["fp16"] = {k: v for k, v in cfg.fp16.items() if k != "fp16"}
    elif cfg.precision == "bfloat16":
        ds["bf16"] = {"enabled": True}
    return ds
