"""`pretrain_partial_init`: start a run from a smaller model's checkpoint, grown in memory (docs/growth.md).

When `load` holds no checkpoint, every rank opens the newest checkpoint in `pretrain_partial_init`, grows
each entry of its own model part with the plan and functions tools/grow_checkpoint.py uses (in the config's
growth_mode), and keeps this tensor rank's block: into the module go the weights and buffers (the
Pattentions' stored token counts), into the optimizer the fp32 masters and, unless the optimizer starts afresh
(growth_optimizer reset: pretrain_partial_init_reset_optimizer, or growth_mode official), Adam's moments and step
(formats/deepspeed/engine_state.py). As in the official TokenFormer code this starts a new stage: iteration, consumed
samples, and so the LR schedule and data position, start at 0; the source's iteration is not carried over.
"""

from __future__ import annotations

import torch

from megatron import mpu
from megatron.checkpoint.parameter_state import ParameterState
from megatron.formats.deepspeed.engine_state import load_parameter_states
from megatron.formats.deepspeed.names import module_model_names, tokenformer_name
from megatron.formats.deepspeed.reader import SourceCheckpoint
from megatron.formats.tensor_parallel import split_dimensions
from megatron.growth.grow import check_entries, grown_state
from megatron.growth.plan import GrowthPlan, pattention_entry, plan_growth


def grow_into(engine, cfg, source: SourceCheckpoint, plan: GrowthPlan | None = None) -> dict[str, int]:
    """Collective: `source` (`cfg.pretrain_partial_init`'s newest checkpoint, a weights-only one in `load`, or the
    one a scheduled growth saved), grown to `cfg`'s model by `plan` (default: planned here), into `engine`.
    Returns the n of √n the grown model holds per slot key (its first layer's, as every rank reads them: a
    pipeline stage may hold other layers)."""
    plan = plan or plan_growth(source.config, cfg)
    check_entries(source.names(), plan)
    fresh_optimizer = plan.resets_optimizer
    pipelined = cfg.pipe_parallel_size >= 1
    dims = split_dimensions(plan.model_args)
    rank, ranks = mpu.get_tensor_parallel_rank(), mpu.get_tensor_parallel_world_size()

    def own_block(name: str, state: ParameterState) -> ParameterState:
        if fresh_optimizer:
            state = state.without_moments()
        if dims[name] is None:
            return state
        return state.map(lambda tensor: tensor.chunk(ranks, dims[name])[rank].clone())

    module = engine.module
    entries = {entry: tokenformer_name(entry, cfg.num_layers, pipelined) for entry in module.state_dict()}
    blocks = {name: own_block(name, grown_state(name, source.state(name), plan)) for name in set(entries.values())}
    with torch.no_grad():
        module.load_state_dict({entry: blocks[name].weight for entry, name in entries.items()})
    load_parameter_states(engine, blocks.__getitem__, None if fresh_optimizer else source.optimizer_step,
                          module_model_names(module, cfg.num_layers, pipelined))
    norms = [(entry[0], name) for name in plan.target_shapes
             if name.startswith("layers.0.") and (entry := pattention_entry(name)) and entry[1] == "norm_token_count"]
    return {key: int(grown_state(name, source.state(name), plan).weight) for key, name in norms}
