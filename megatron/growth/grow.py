"""Grow one parameter's training state, whole, as the plan says (TokenFormer §3.3, docs/growth.md).

For each Pattention with n → n' tokens, in growth mode `preserve`:
  key tokens    the n old rows bit-exact, then n' − n zero rows: a zero key scores 0 for every input,
                which adds nothing to the L2 norm of Θ and gets weight GeLU(0) = 0, so the grown layer
                computes the same function;
  value tokens  the old rows, then rows n..n' of the value init a fresh model of the target size would
                draw (init_methods.initial_value: same seed, same full shape, whatever the layout), or
                zeros with `zero_new_values`. A zero key's gradient is proportional to its value, so
                zero keys with zero values would never learn;
  Adam moments  the old rows, then zeros: training continues as if the model had always been larger;
  n of √n       (`norm_token_count`) stays the old n, which keeps the normalisation, hence the function.
(`growth_norm_token_count: new` sets n of √n to n' instead; the function then changes.)
Shrinking (n' < n) keeps the first n' rows and normalises with min(n, n'): lossy, except that it undoes an
untrained growth exactly. Every other entry passes unchanged.

In growth mode `official`, as the official code's custom_load_fn_incremental: the old rows of keys and values
copied into a fresh init of the target model (new key and value rows drawn as above) and n of √n the new
count n' (a fresh model's, unless `growth_norm_token_count: old`): the grown model computes another function.
Its users start the iteration afresh, and the optimizer too unless `growth_optimizer: carry`
(GrowthPlan.resets_optimizer, dropped by the caller), as that code does. Every other entry passes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from megatron.checkpoint.parameter_state import ParameterState
from megatron.cli import InputError
from megatron.growth.plan import GrowthPlan, pattention_entry
from megatron.model.init_methods import initial_value


def _resized(rows: Tensor, count: int, initialize: Callable[[Tensor], object] | None = None) -> Tensor:
    """The first `count` rows of `rows`, or all of them followed by new rows: zeros, or what `initialize`
    draws into the whole new tensor (the old rows then overwrite their part). No temporary: memory bandwidth
    dominates growing a large checkpoint."""
    old = rows.shape[0]
    if count <= old:
        return rows if count == old else rows[:count].clone()
    grown = torch.empty((count, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    if initialize is None:
        grown[old:].zero_()
    else:
        initialize(grown)
    grown[:old] = rows
    return grown


def grown_state(name: str, state: ParameterState, plan: GrowthPlan) -> ParameterState:
    """`state` of TokenFormerModel entry `name`, grown (or shrunk) to the target model's shape."""
    expected = plan.source_shape(name)
    if tuple(state.weight.shape) != expected:
        raise InputError(f"{name}: the source checkpoint holds shape {tuple(state.weight.shape)}, but its "
                         f"config.json describes {expected}; the checkpoint does not match its config")
    entry = pattention_entry(name)
    if entry is None:
        return state
    slot_key, leaf = entry
    count = plan.new_tokens[slot_key]
    official = plan.mode == "official"
    if leaf == "norm_token_count":
        kept = torch.full_like(state.weight, count) if plan.norm == "new" else torch.clamp(state.weight, max=count)
        return ParameterState(kept)
    width = state.weight.shape[1]
    if (leaf == "key_param_tokens" and not official) or plan.zero_new_values:
        weight = _resized(state.weight, count)
    else:  # rows old.. of the init a fresh model of the target size draws
        weight = _resized(state.weight, count, lambda grown: initial_value(
            name, (count, width), plan.roles[name], plan.target.seed, plan.model_args, out=grown))
    if not state.has_moments:
        return ParameterState(weight)
    return ParameterState(weight, _resized(state.exp_avg, count), _resized(state.exp_avg_sq, count))


def check_entries(names: Iterable[str], plan: GrowthPlan) -> None:
    """The source checkpoint must hold exactly the entries of the model its config describes."""
    names = set(names)
    missing, unexpected = sorted(set(plan.target_shapes) - names), sorted(names - set(plan.target_shapes))
    if missing or unexpected:
        raise InputError(f"the source checkpoint's entries do not match the model its config describes: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")


def grown_states(names: Iterable[str], state: Callable[[str], ParameterState],
                 plan: GrowthPlan) -> Iterator[tuple[str, ParameterState]]:
    """(name, grown state) for every entry, reading the source's `state(name)` one at a time."""
    names = list(names)
    check_entries(names, plan)
    for name in names:
        yield name, grown_state(name, state(name), plan)
