"""Resume a live DeepSpeed engine from a checkpoint checkpoint/save.py (or the grow tool) wrote.

The run's parallel layout and tensor shapes are checked against the checkpoint's first (compatibility.py):
DeepSpeed would stop at the first size mismatch with its own message. DeepSpeed then loads its files; a
checkpoint the grow tool wrote holds its optimizer state apart from DeepSpeed's files (portable.py), restored
after them (restore.py); last, every rank's random generators.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.checkpoint.engine_optimizer import check_supported
from megatron.checkpoint.rng_state import restore_rng_state
from megatron.checkpoint.safety import load_weights_only
from megatron.config.validate import raise_if_any
from megatron.formats.deepspeed.compatibility import architecture_problems, layout_problems, tensor_problems
from megatron.formats.deepspeed.portable import is_portable
from megatron.formats.deepspeed.restore import restore_portable_state


def load_checkpoint(engine, cfg, tag: str, load_optimizer: bool = True) -> tuple[int, int]:
    """Restore checkpoint `tag` of `cfg.load` (selection.resume_tag's verified choice); returns
    (iteration, consumed samples). One the grow tool wrote holds its optimizer state apart from DeepSpeed's
    files (portable.py): restored after them."""
    tag_dir = Path(cfg.load) / tag
    portable = is_portable(tag_dir)
    # The layout first: the tensors are compared as this run splits them.
    zero_state = load_optimizer and not portable and dist.is_initialized()
    raise_if_any(layout_problems(tag_dir, cfg, mpu.get_data_parallel_world_size() if zero_state else None)
                 or tensor_problems(tag_dir, cfg, cfg.padded_vocab_size) or architecture_problems(tag_dir, cfg))
    if portable and load_optimizer:
        check_supported(engine.optimizer)
    # no_grad: a pipeline re-broadcasts its tied weight in place while loading (see model/pipeline.py).
    with torch.no_grad():
        path, client_state = engine.load_checkpoint(
            cfg.load,
            tag=tag,
            load_optimizer_states=load_optimizer and not portable,
            load_lr_scheduler_states=False,
            load_module_strict=True,
        )
    if path is None:
        raise FileNotFoundError(
            f"load: {cfg.load}/latest names {tag!r} but DeepSpeed could not read that checkpoint"
        )
    if portable and load_optimizer:
        restore_portable_state(engine, cfg, Path(cfg.load) / tag)
    rng_file = Path(cfg.load) / tag / f"rng_state_{dist.get_rank()}.pt"
    if rng_file.is_file():
        restore_rng_state(load_weights_only(rng_file))
    return client_state["iteration"], client_state["consumed_train_samples"]
