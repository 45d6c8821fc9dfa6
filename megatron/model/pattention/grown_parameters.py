"""Growing a Pattention's token matrices in place, so that no optimizer steps without the new tokens.

Pattention.grow() keeps its key_param_tokens and value_param_tokens Parameter objects and gives them more rows:
an optimizer built before the growth holds the same Parameters, so it trains every token, the new ones too.
Where it has already stepped, its per-parameter state (Adam's moments, SGD's momentum) still has the old row
count; torch would meet that with a shape error deep inside its update, so a step pre-hook, installed for every
optimizer at the first growth in the process, names the layer and the fix first. The hook looks at the
parameters grown in this process only: nothing for code that never grows a layer.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

_GROWN: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()  # by id: tensors compare by value
_HOOK: list[object] = []  # the hook's handle, once installed


def append_rows(parameter: nn.Parameter, rows: Tensor) -> None:
    """`rows` appended to `parameter` in place (the same Parameter object, its gradient dropped: it has the old
    shape), and the parameter watched for optimizers holding state of the old shape."""
    parameter.data = torch.cat([parameter.data, rows.to(parameter.dtype)])
    parameter.grad = None
    _GROWN[id(parameter)] = parameter
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_stale_state))


def _refuse_stale_state(optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
    for parameter in list(_GROWN.values()):
        state = optimizer.state.get(parameter)  # .get: the state is a defaultdict, which must not gain entries
        stale = sorted(name for name, value in (state or {}).items()
                       if isinstance(value, Tensor) and value.dim() and value.shape != parameter.shape)
        if stale:
            old = state[stale[0]].shape[0]
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): a Pattention grew from {old} to {parameter.shape[0]} parameter "
                f"tokens after this optimizer stepped, and its state ({', '.join(stale)}) still has {old} rows; "
                "build a new optimizer over the layer's parameters after grow(), or grow before the first step")
