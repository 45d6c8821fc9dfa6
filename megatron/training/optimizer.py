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

_FUSED_ADAMW_DEVICES = ("cuda", "cpu", "xpu", "mps")


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split parameters into a decayed group (matrices) and a non-decayed one (1-D)."""
    decay, no_decay = [], []
    for _, param in sorted(model.named_parameters()):
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, cfg, device_type: str) -> torch.optim.Optimizer:
    params = (cfg.optimizer or {}).get("params", {})
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=tuple(params.get("betas", (0.9, 0.999))),
        eps=params.get("eps", 1e-8),
        # torch's fused AdamW kernel (one pass over all tensors) where it exists.
        fused=True if device_type in _FUSED_ADAMW_DEVICES else None,
    )


def deepspeed_config(cfg) -> dict[str, Any]:
    """The DeepSpeed engine's config: batch sizes, clipping, ZeRO and precision."""
    ds: dict[str, Any] = {
        "train_batch_size": cfg.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping,
        "zero_optimization": dict(cfg.zero_optimization or {"stage": 0}),
        # We log ourselves every log_interval; keep DeepSpeed's own prints rare.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Our optimizer is plain torch AdamW, which ZeRO partitions correctly.
        "zero_allow_untested_optimizer": True,
    }
    if cfg.precision == "fp16":
        ds["fp16"] = {k: v for k, v in cfg.fp16.items() if k != "fp16"}
    elif cfg.precision == "bfloat16":
        ds["bf16"] = {"enabled": True}
    return ds
