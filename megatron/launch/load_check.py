"""What a training run's `load` holds, judged before launch: a `load` holding no checkpoint to choose from would
otherwise start the run from scratch without a word (a checkpoint's own global_stepN directory, as GPT-NeoX users
pass it; an export; a data folder; a mistyped path).

`load` = `save` with nothing there yet is the usual fresh start (the configs set both; the run says so in one
line, checkpoint/selection.py). Any other `load` must be a save directory holding checkpoints, or is refused
with the fix.
"""

from __future__ import annotations

from pathlib import Path

from megatron.checkpoint.commit import CHECKPOINT_TAG, LATEST, read_latest
from megatron.checkpoint.selection import holds_checkpoints
from megatron.config import Config
from megatron.formats import huggingface
from megatron.formats.consolidated import weights_in_directory
from megatron.formats.deepspeed.files import tag_directory

_RESUME_OR_START = ("point load at the save directory of the run to resume (the folder holding global_stepN/ and "
                    "`latest`), or set load to save (or unset it) to start from scratch")


def _one_checkpoint_problem(tag_dir: Path) -> str:
    """The fix for a `load` that is one checkpoint's directory: its save directory, or a save directory made."""
    run = tag_dir.parent
    if not (CHECKPOINT_TAG.match(tag_dir.name) and holds_checkpoints(run)):
        return (f"load = {tag_dir} holds one checkpoint's files but is not a save directory: move it into one, as "
                f"DIR/global_stepN/ with a file DIR/{LATEST} holding global_stepN, and set load=DIR")
    marker = run / LATEST
    try:
        named = read_latest(run)
    except ValueError:
        named = None  # damaged: resuming takes the newest complete checkpoint (checkpoint/selection.py)
    resumes = f"which resumes {named} ({marker} names it)" if named else "which resumes its newest complete checkpoint"
    itself = "" if named == tag_dir.name else f"; to resume {tag_dir.name} itself, write {tag_dir.name} into {marker}"
    return (f"load = {tag_dir} is one checkpoint of the run in {run}, but load is the save directory holding a run's "
            f"checkpoints: set load={run}, {resumes}{itself}")


def _exported_weights_problem(path: Path) -> str | None:
    """The fix for a `load` holding exported weights, which a run cannot resume from; None if it holds none."""
    if huggingface.recognises(path):
        return (f"load = {path} is a Hugging Face model directory, not a training checkpoint: convert it with "
                f"tools/convert_from_hf.py {path} OUT --config YOUR.yml, then set load=OUT")
    weights = weights_in_directory(path)
    if weights is None:
        return None
    return (f"load = {path} holds exported weights ({weights}), not a training checkpoint: set load to the save "
            "directory of the run they came from; tools/convert_official_checkpoint.py imports the official "
            "release's pytorch_model.bin into one, tools/convert_from_hf.py a Hugging Face export")


def load_problem(cfg: Config) -> str | None:
    """Why a training run cannot resume from `cfg.load` though it holds no checkpoint to choose from; None if it
    holds some (selection.py chooses), or if it is `save` with nothing there yet and the run trains."""
    load = Path(cfg.load)
    if holds_checkpoints(load):
        return None
    if load.is_dir() and tag_directory(load) == load:
        return _one_checkpoint_problem(load)
    if load.is_file():
        return f"load = {load} is a file, not a save directory: {_RESUME_OR_START}"
    exported = _exported_weights_problem(load) if load.is_dir() else None
    if exported:
        return exported
    if cfg.eval_only:
        return f"eval_only: load = {load} holds no checkpoint to evaluate (no `{LATEST}`, no global_stepN/)"
    if cfg.save and load.resolve() == Path(cfg.save).resolve():
        return None
    save = f" and is not save ({cfg.save}), where a new run starts" if cfg.save else ""
    if not load.exists():
        return f"load = {load} does not exist{save}: {_RESUME_OR_START}"
    return f"load = {load} holds no checkpoint (no `{LATEST}`, no global_stepN/){save}: {_RESUME_OR_START}"
