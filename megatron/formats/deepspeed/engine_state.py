"""Set a live engine's training state from ParameterStates: module weights, fp32 masters, Adam's moments
and step count; the last step of resuming a grown or re-sharded checkpoint (portable_restore.py).

DeepSpeed loads such a checkpoint's weights into the module (cast to its dtype) and, for a bf16 run, copies
those rounded values into the masters; this puts back the exact fp32 masters and the moments, wherever the
optimizer keeps them (engine_optimizer.py), so training continues as if it had never stopped. Partitioned
optimizers get each data-parallel rank's fragment through DeepSpeed's own link (`safe_set_full_*`), so any
data-parallel size and ZeRO stage 1/2 load the same states.

A run with freeze_old_param_tokens trains a partly frozen matrix as `parametrizations.<matrix>.original`,
its block's trailing rows (model/frozen_tokens.py): that parameter gets those rows of the block's weight,
master and moments, so the rows it trains keep their Adam state. A wholly frozen matrix is a buffer, outside
the optimizer: it gets its weight with the module's (DeepSpeed's load, or the caller's load_state_dict).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
from torch import Tensor

from megatron.checkpoint.engine_optimizer import base_optimizer, is_partitioned, master_pairs, step_tensor
from megatron.checkpoint.parameter_state import ParameterState
from megatron.cli import InputError
from megatron.formats.deepspeed.names import holds_trailing_rows

MOMENTS = ("exp_avg", "exp_avg_sq")


def _check(module_name: str, model_name: str, state: ParameterState, param: Tensor) -> None:
    shapes = {tuple(t.shape) for t in state.tensors()}
    if shapes != {tuple(param.shape)}:
        raise InputError(f"{model_name} (parameter {module_name}): the checkpoint gives this rank a block of shape "
                         f"{sorted(shapes)}, the model's block is {tuple(param.shape)}; load it with the config "
                         "it was written for (its config.json)")


def _fresh_partition_state(optimizer, params: list[Tensor], step: int) -> None:
    """Adam state of every flat partition (zero moments, `step`), linked to the fragments of `params`.
    DeepSpeed creates it at the first step, and links it after the first group's step, when the others have
    none yet (0.19.8)."""
    inner = base_optimizer(optimizer)
    for group in inner.param_groups:
        flat = group["params"][0]
        inner.state[flat] = {"step": step_tensor(step, group, flat), "exp_avg": torch.zeros_like(flat),
                             "exp_avg_sq": torch.zeros_like(flat)}
    for param in params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            flat = inner.param_groups[mapping.param_group_index]["params"][0]
            mapping.set_optim_state_fragment(flat, inner.state[flat])


def _set_partitioned(param: Tensor, state: ParameterState, step: int | None) -> None:
    """This data-parallel rank's fragments (if any) of the master and moments."""
    safe_set_full_fp32_param(param, state.weight.to(param.device))
    if step is not None and state.has_moments:
        for key, moment in zip(MOMENTS, (state.exp_avg, state.exp_avg_sq), strict=True):
            safe_set_full_optimizer_state(param, moment.to(param.device), key)


def _set_per_parameter(optimizer, master: Tensor, group: dict, state: ParameterState, step: int | None) -> None:
    master.copy_(state.weight)
    if step is not None:
        moments = (state.exp_avg, state.exp_avg_sq) if state.has_moments else (None, None)
        optimizer.state[master] = {"step": step_tensor(step, group, master), **{
            key: torch.zeros_like(master) if moment is None else moment.to(master)
            for key, moment in zip(MOMENTS, moments, strict=True)}}


def load_parameter_states(engine, states: Callable[[str], ParameterState], step: int | None,
                          model_names: Mapping[str, str]) -> None:
    """For every parameter of `engine.module` (on this rank): weight, fp32 master and, when `step` is given,
    Adam's moments (zero where a state has none) and step count. `states(model name)` gives this rank's
    whole block (a frozen run's trainable rows take its trailing rows); `model_names` maps the module's
    parameter names to TokenFormerModel's (names.py). With
    `step` None the optimizer state is left as it is (a fresh optimizer starts from zero). Raises
    UnsupportedOptimizer (ZeRO stage 3, fused fp16) before setting anything."""
    optimizer = engine.optimizer
    partitioned = is_partitioned(optimizer)
    pairs = [] if partitioned else master_pairs(optimizer)
    inner = base_optimizer(optimizer)
    masters = {param: (master, group) for group_pairs, group in zip(pairs, inner.param_groups)
               for param, master in group_pairs}
    params = dict(engine.module.named_parameters())
    unnamed = sorted(set(params) - set(model_names))
    if unnamed:
        raise ValueError(f"no TokenFormerModel name given for parameters {unnamed[:5]}")
    with torch.no_grad():
        if partitioned and step is not None:
            _fresh_partition_state(optimizer, list(params.values()), step)
        for name, param in params.items():
            state = states(model_names[name])
            if holds_trailing_rows(name):
                state = state.map(lambda tensor, rows=param.shape[0]: tensor[-rows:])
            _check(name, model_names[name], state, param)
            param.copy_(state.weight)
            if partitioned:
                _set_partitioned(param, state, step)
            elif param in masters:  # else not trained (frozen)
                _set_per_parameter(inner, *masters[param], state, step)
