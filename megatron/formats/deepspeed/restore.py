"""Resume training from a checkpoint the grow tool wrote (portable.py), with nothing to set but `load`.

checkpointing.load_checkpoint has DeepSpeed load its model files (the weights, into the module) without
optimizer state; this then puts in the exact fp32 masters, Adam's moments and step count from the
layout-independent files, whatever ZeRO stage, precision and data-parallel size the run has. The files
cover every token, so a run with freeze_old_param_tokens resumes them too: the rows it trains keep their
state (engine_state.py).
"""

from __future__ import annotations

from pathlib import Path

from megatron import mpu
from megatron.formats.deepspeed.engine_state import load_parameter_states
from megatron.formats.deepspeed.names import module_model_names
from megatron.formats.deepspeed.reader import read_checkpoint


def restore_portable_state(engine, cfg, tag_dir: Path) -> None:
    """This rank's blocks of the verified checkpoint in `tag_dir`, saved in `cfg`'s layout, into `engine`."""
    source = read_checkpoint(tag_dir)
    rank = mpu.get_tensor_parallel_rank()
    names = module_model_names(engine.module, cfg.num_layers, cfg.pipe_parallel_size >= 1)
    load_parameter_states(engine, lambda name: source.block(name, rank), source.optimizer_step, names)
