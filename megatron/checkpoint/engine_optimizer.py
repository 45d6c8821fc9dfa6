"""Where a live DeepSpeed engine keeps each parameter's fp32 master weight and Adam state.

Our optimizer is torch AdamW (training/optimizer.py); what DeepSpeed wraps it in depends on the run:

    ZeRO stage 0, fp32                  nothing: each module parameter is its own master, its moments are
                                        in optimizer.state[parameter]                       ("per parameter")
    ZeRO stage 0, bf16/fp16, no pipeline  FP16_UnfusedOptimizer: an fp32 copy of each parameter (fp32_groups,
                                        beside the module's fp16_groups), moments in state[copy] ("per parameter")
    ZeRO stage 1/2 (DeepSpeedZeroOptimizer), ZeRO stage 0 bf16 with a pipeline (BF16_Optimizer)
                                        per parameter group one flat fp32 partition on each data-parallel
                                        rank, moments in state[partition]; `param._hp_mapping` locates a
                                        parameter's fragment in it (DeepSpeed's universal-checkpoint link)
                                                                                            ("partitioned")

Per-parameter state is saved without names (torch numbers it), so `optimizer_parameter_names` is saved with
it (save.py) for a reader to tell which is which; partitioned state names itself
(`param_slice_mappings`).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from torch import Tensor, nn

# client_state key of DeepSpeed's model files: the module's parameter names in the per-parameter state's order.
OPTIMIZER_PARAMETER_NAMES = "optimizer_parameter_names"


class UnsupportedOptimizer(ValueError):
    """An engine optimizer whose state growth cannot read or set."""


def is_partitioned(optimizer) -> bool:
    return isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer))


def check_supported(optimizer) -> None:
    """UnsupportedOptimizer unless the optimizer is one of the table's."""
    if not (is_partitioned(optimizer) or isinstance(optimizer, (FP16_UnfusedOptimizer, torch.optim.Optimizer))):
        raise UnsupportedOptimizer(
            f"{type(optimizer).__name__} (DeepSpeed's optimizer for this run, e.g. ZeRO stage 3) keeps its state "
            "in a form a grown or re-sharded checkpoint's fp32 masters and Adam moments cannot be loaded into: "
            "train from it with ZeRO stage 0, 1 or 2 (zero_optimization: {stage: 1})")


def master_pairs(optimizer) -> list[list[tuple[nn.Parameter, Tensor]]]:
    """Per parameter group, (module parameter, its fp32 master) of a per-parameter optimizer."""
    check_supported(optimizer)
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return [list(zip(low, high, strict=True)) for low, high in zip(optimizer.fp16_groups, optimizer.fp32_groups)]
    return [[(param, param) for param in group["params"]] for group in optimizer.param_groups]


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch AdamW holding the moments."""
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def optimizer_parameter_names(engine) -> list[list[str]] | None:
    """The module's names of the per-parameter state's parameters, by group; None for any other state."""
    if not isinstance(engine.optimizer, (FP16_UnfusedOptimizer, torch.optim.Optimizer)):
        return None
    names = {param: name for name, param in engine.module.named_parameters()}
    return [[names[param] for param, _ in group] for group in master_pairs(engine.optimizer)]


def step_tensor(step: int, group: dict, master: Tensor) -> Tensor:
    """Adam's step count as torch AdamW keeps it: on the parameter's device for the fused and capturable
    kernels, else on the CPU (torch/optim/adam.py)."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=master.device if on_device else "cpu")
