"""Resume a checkpoint saved on another tensor, pipeline or data-parallel layout (docs/cluster.md, "When your
allocation changes").

Where the checkpoint a run resumes was saved with another model_parallel_size or pipe_parallel_size, or holds
ZeRO optimizer state partitioned over another data-parallel size (compatibility.py), deepy.py writes it
re-sharded into the run's layout beside it before launch, as `global_stepN-tp1pp1dp4`, with the grow tool's
code and the slot counts unchanged (grow_checkpoint.py: weights, fp32 masters, Adam's moments and step,
iteration, consumed samples, n of √n and growth record kept; its optimizer state is portable.py's, which any
data-parallel size loads). The original is only read and `latest` still names it. The copy is written in
`.tmp-reshard-<its name>/` and renamed beside the original once committed with its manifest: a kill leaves
the original as it was, and the next start removes the work folder and re-shards again. A later resume on the
same layout reuses the copy (written again if files of it are missing or cut short). The ranks load the copy in place of the checkpoint chosen (`tag_for_this_layout`),
verified as any checkpoint is. One process writes: deepy.py, before any rank starts, on the file system the
ranks share; where the ranks were started without it, rank 0, in a process of its own, while the others wait.
`reshard_on_resume: false` keeps compatibility.py's refusal.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from megatron.checkpoint.commit import STAGING_PREFIX
from megatron.checkpoint.manifest import sync_directory
from megatron.checkpoint.selection import checkpoint_problems, present_file_problems
from megatron.checkpoint.work_split import is_rank_0, same_on_all_ranks
from megatron.config import Config, ConfigError
from megatron.formats.deepspeed.compatibility import holds_weights_only, layout_problems
from megatron.growth.grow_checkpoint import write_grown_checkpoint

WORK_PREFIX = f"{STAGING_PREFIX}reshard-"


def data_parallel_size(cfg: Config, processes: int) -> int:
    return processes // (cfg.model_parallel_size * max(1, cfg.pipe_parallel_size))


def resharded_tag(tag: str, cfg: Config, data_parallel: int) -> str:
    """The name of checkpoint `tag` re-sharded into `cfg`'s layout on `data_parallel` ranks."""
    return f"{tag}-tp{cfg.model_parallel_size}pp{cfg.pipe_parallel_size}dp{data_parallel}"


def _layout(tensor: int, pipe: int, data: int | None) -> str:
    return f"TP {tensor} × PP {pipe}" + ("" if data is None else f" × DP {data}")


def saved_layout(tag_dir: Path) -> str:
    """The layout `tag_dir` was saved on, from its config.json, in the words of the line deepy.py prints (the
    data-parallel size where it says the world size: a tool's output does not)."""
    saved = json.loads((tag_dir / "config.json").read_text(encoding="utf-8"))
    tensor, pipe = saved.get("model_parallel_size", 1), saved.get("pipe_parallel_size", 0)
    world = saved.get("world_size")
    return _layout(tensor, pipe, world // (tensor * max(1, pipe)) if isinstance(world, int) else None)


def needs_reshard(tag_dir: Path, cfg: Config, data_parallel: int) -> bool:
    """Whether the run cannot load `tag_dir` as it is: another tensor or pipeline layout, or ZeRO state over
    another data-parallel size (a frozen run loads weights only: any data-parallel size). Weights alone load
    into any layout."""
    ranks = None if cfg.freeze_old_param_tokens else data_parallel
    return not holds_weights_only(tag_dir) and bool(layout_problems(tag_dir, cfg, ranks))


def _size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _in_words(size: int) -> str:
    return f"{size / 2**30:,.2f} GiB" if size >= 2**30 else f"{size / 2**20:,.1f} MiB"


def disk_problem(tag_dir: Path) -> str | None:
    """The re-shard writes about as much as the checkpoint holds (fp32 weights and Adam's moments) beside it;
    why there is not that much free space there, or None."""
    needed, free = _size(tag_dir), shutil.disk_usage(tag_dir.parent).free
    if free >= needed:
        return None
    return (f"load: re-sharding {tag_dir} ({_in_words(needed)}) into this run's layout needs about as much free "
            f"space beside it, but {tag_dir.parent} has {_in_words(free)} free: make room there, or resume "
            f"on the layout it was saved with ({saved_layout(tag_dir)}), or re-shard it elsewhere with "
            "tools/grow_checkpoint.py")


def reshard(load: Path, tag: str, cfg: Config, data_parallel: int) -> tuple[str, bool]:
    """Checkpoint `tag` of `load` re-sharded into `cfg`'s layout on `data_parallel` ranks: its tag, and
    whether this call wrote it (False: an earlier resume did). One process, no process group."""
    name = resharded_tag(tag, cfg, data_parallel)
    final = load / name
    if final.is_dir() and not present_file_problems(final):
        return name, False
    shutil.rmtree(final, ignore_errors=True)  # a copy with files missing or cut short: derived, written again
    work = load / f"{WORK_PREFIX}{name}"
    shutil.rmtree(work, ignore_errors=True)  # a re-shard killed before it finished
    source = load / tag
    problem = disk_problem(source)
    if problem:
        raise ConfigError(problem)
    saved = json.loads((source / "config.json").read_text(encoding="utf-8"))
    # The checkpoint's model in this run's layout, whose batch sizes its config.json then states consistently
    this_run = ("model_parallel_size", "pipe_parallel_size", "world_size", "train_batch_size",
                "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    target = Config.from_dict({**saved, **{key: getattr(cfg, key) for key in this_run}})
    written, _ = write_grown_checkpoint(source, work, target)
    written.rename(final)  # committed with its manifest in `work`: renamed whole, or not at all
    sync_directory(load)
    shutil.rmtree(work)
    return name, True


def resharded_line(cfg: Config, tag: str | None, processes: int) -> str | None:
    """deepy.py, once every check passed: where checkpoint `tag` of `cfg.load` does not fit the run's layout,
    re-shard it (or find it re-sharded) and return the line saying so; None where it fits as it is."""
    if tag is None or not cfg.reshard_on_resume:
        return None
    load, data_parallel = Path(cfg.load), data_parallel_size(cfg, processes)
    if not needs_reshard(load / tag, cfg, data_parallel):
        return None
    name, written = reshard(load, tag, cfg, data_parallel)
    now = _layout(cfg.model_parallel_size, cfg.pipe_parallel_size, data_parallel)
    how = "re-sharded into" if written else "re-sharded before, reusing"
    return f"resuming {tag} ({saved_layout(load / tag)}) as {now}: {how} {name}"


def _reshard_in_a_process(cfg: Config, tag: str, processes: int) -> str:
    """resharded_line in a process of its own, outside the ranks' process group (the grow tool's code verifies
    and commits as one process); its line, or ConfigError with its error."""
    repository = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [repository, os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", __name__, tag, str(processes)], input=cfg.to_json(), text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": path})
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        raise ConfigError(lines[-1] if lines else f"load: re-sharding {tag} failed (exit code {done.returncode})")
    return done.stdout.strip().splitlines()[-1]


def tag_for_this_layout(cfg: Config, tag: str | None, data_parallel: int) -> str | None:
    """Collective, in the ranks: the checkpoint to load for `tag` (resume_tag's choice): its copy re-sharded into
    this layout where it needs one, verified as resume_tag verifies `tag`. Launched by deepy.py, the copy is
    there; launched otherwise (srun train.py), rank 0 writes it while the others wait. `tag` where it fits, or
    with reshard_on_resume false (the load then refuses it, naming the fix)."""
    if tag is None or not cfg.reshard_on_resume or not needs_reshard(Path(cfg.load) / tag, cfg, data_parallel):
        return tag
    name = resharded_tag(tag, cfg, data_parallel)
    failure = None
    if is_rank_0() and not (Path(cfg.load) / name).is_dir():
        try:
            print(_reshard_in_a_process(cfg, tag, dist.get_world_size()), flush=True)
        except ConfigError as error:
            failure = str(error)
    failure = same_on_all_ranks(failure)
    if failure:
        raise ConfigError(failure)
    problems = checkpoint_problems(Path(cfg.load) / name)
    if problems:
        raise ConfigError(f"load: {Path(cfg.load) / name}, {tag} re-sharded into this layout, cannot be read: "
                          f"{'; '.join(problems)}. Delete it: the next start re-shards {tag} again")
    return name


if __name__ == "__main__":  # rank 0's re-shard (tag_for_this_layout): the config on stdin; the tag, the world size
    try:
        print(resharded_line(Config.from_json(sys.stdin.read()), sys.argv[1], int(sys.argv[2])))
    except ConfigError as error:
        sys.exit(str(error))
