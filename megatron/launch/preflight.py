"""What deepy.py checks in the files a run will read before any process starts, beyond the config itself
(`check_run_inputs`): a problem found here is named once, before anything starts; found in the ranks it costs a
launch and prints one traceback per rank.

- the tokenizer loads (a vocab_file that is not a tokenizer is named), giving the padded vocabulary;
- every dataset: headers, sizes, documents, token ids within the vocabulary (megatron/data/dataset_check.py),
  and that `split` gives the train part of data_path a share and at least one global batch of text;
- `load` holds checkpoints, or is `save` with nothing there yet (load_check.py);
- the checkpoint a training run resumes from: files present, pickles screened (megatron/checkpoint/safety.py), its
  layout and every tensor against the model (megatron/formats/deepspeed/compatibility.py; saved on another
  layout: as saved, and the free space its re-shard takes, megatron/growth/reshard_on_resume.py), and, with
  norm_token_count_ramp_iters, a growth record saying where the ramp starts and, mid-ramp, the length the
  checkpoint was saved with (megatron/growth/norm_ramp.py);
- the save directory is not in use by another run (megatron/checkpoint/save_lock.py) and, on a launch from this
  machine, it and log_dir (generate.py: sample_output_file's folder) can be written (or created);
- on a launch from this machine, master_port is free;
- the cluster check's golden curve file, field by field (megatron/config/golden_curve.py).

`preflight_notes` says what is allowed but likely unintended: a train split that training reads many times;
`nothing_left_to_train`, that a run need not start: its checkpoint already reached train_iters;
`reshard_before_launch` re-shards a checkpoint saved on another layout, once all of this passed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from megatron.checkpoint.growth_record import GrowthRecordError, read_growth_record
from megatron.checkpoint.safety import CheckpointRefused, load_checkpoint_file
from megatron.checkpoint.save_lock import SaveDirectoryInUse, check_save_directory_free
from megatron.checkpoint.selection import (newest_usable_tag, screened_file_problems, tag_to_resume_before_launch,
                                           verified_file_problems)
from megatron.config import Config, ConfigError
from megatron.config.eval_tasks import eval_task_problems
from megatron.config.golden_curve import REPOSITORY_CURVE, CurveError, read_curve
from megatron.config.run_inputs import CLUSTER_CHECK_SCRIPT, INFERENCE_SCRIPTS, dataset_prefixes
from megatron.data.data_utils import train_split_problem, train_split_repeats, train_split_shortfall
from megatron.data.dataset_check import dataset_problems
from megatron.data.indexed_dataset import IndexedDatasetError, index_file_path, read_index_header, sequence_sizes
from megatron.formats.consolidated import weights_location_problem
from megatron.formats.deepspeed.files import MODEL_FILE, files_by_rank
from megatron.formats.deepspeed.compatibility import (
    architecture_problems,
    holds_weights_only,
    layout_problems,
    tensor_problems,
)
from megatron.growth.norm_ramp import norm_ramp, resumed_ramp_problem
from megatron.growth.reshard_on_resume import (data_parallel_size, disk_problem, needs_reshard, resharded_line,
                                               resharded_tag)
from megatron.growth.schedule import config_for_checkpoint
from megatron.launch.hosts import is_local_host
from megatron.launch.load_check import load_problem
from megatron.launch.ports import is_free, master_port
from megatron.launch.resources import Slots, world_size
from megatron.model.args import args_problem
from megatron.tokenizer import build_tokenizer, pad_vocab_size


def _padded_vocabulary(cfg: Config) -> tuple[int | None, list[str]]:
    try:
        tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)
    except Exception as error:  # noqa: BLE001 - tokenizer libraries raise their own types (Rust, protobuf)
        reason = (str(error) or type(error).__name__).splitlines()[0]
        return None, [f"vocab_file = {cfg.vocab_file!r} cannot be read as a {cfg.tokenizer_type} tokenizer "
                      f"({reason}); point vocab_file at the tokenizer the data was prepared with"]
    return pad_vocab_size(tokenizer.vocab_size, cfg.make_vocab_size_divisible_by, cfg.model_parallel_size), []


def _resume_problems(cfg: Config, vocabulary: int, processes: int) -> list[str]:
    try:
        tag, _ = tag_to_resume_before_launch(cfg.load)  # screened: nothing below unpickles what may run code
    except CheckpointRefused as error:
        return [str(error)]
    if tag is None:
        return _norm_ramp_problems(cfg, None)
    cfg = config_for_checkpoint(cfg, tag)  # with a growth schedule, the model grown as listed before it
    tag_dir = Path(cfg.load) / tag
    ramp = _norm_ramp_problems(cfg, tag_dir)
    if ramp:
        return ramp
    if holds_weights_only(tag_dir):  # loaded into any layout
        return tensor_problems(tag_dir, cfg, vocabulary, saved_layout=True) or architecture_problems(tag_dir, cfg)
    data_parallel = data_parallel_size(cfg, processes)
    if cfg.reshard_on_resume and needs_reshard(tag_dir, cfg, data_parallel):  # deepy.py re-shards it
        resharded = (Path(cfg.load) / resharded_tag(tag, cfg, data_parallel)).is_dir()
        return (tensor_problems(tag_dir, cfg, vocabulary, saved_layout=True) or architecture_problems(tag_dir, cfg)
                or ([] if resharded else list(filter(None, [disk_problem(tag_dir)]))))
    # A frozen run whose checkpoint was saved with another freeze loads weights only: any data-parallel size.
    return (layout_problems(tag_dir, cfg, None if cfg.freeze_old_param_tokens else data_parallel)
            or tensor_problems(tag_dir, cfg, vocabulary) or architecture_problems(tag_dir, cfg))


def _norm_ramp_problems(cfg: Config, tag_dir: Path | None) -> list[str]:
    """norm_token_count_ramp_iters needs where its ramp starts: the growth record of the checkpoint resumed, or the
    growth pretrain_partial_init makes when there is none. A checkpoint saved mid-ramp is resumed on the same ramp,
    whether or not this run sets one."""
    if tag_dir is None and (not cfg.norm_token_count_ramp_iters or cfg.pretrain_partial_init or cfg.growth_schedule):
        return []
    try:
        record = None if tag_dir is None else read_growth_record(tag_dir)
        if record is not None or not cfg.growth_schedule:  # else the ramp starts at the schedule's first growth
            norm_ramp(cfg, record)
        problem = None if tag_dir is None else resumed_ramp_problem(cfg, tag_dir, record)
    except (ConfigError, GrowthRecordError) as error:
        return [f"{tag_dir or 'load'}: {error}"]
    return [f"{tag_dir}: {problem}"] if problem else []


def _iteration(tag_dir: Path) -> int | None:
    """The iteration a checkpoint resumes at; None for weights only (a start at iteration 0)."""
    if holds_weights_only(tag_dir):
        return None
    return load_checkpoint_file(files_by_rank(tag_dir, MODEL_FILE)[(0,)]).get("iteration", 0)


def nothing_left_to_train(cfg: Config) -> str | None:
    """Why a training run that passed preflight_problems would stop as soon as it started: the checkpoint it
    resumes already reached train_iters (launched, it would only say so, after start-up); None otherwise.
    ConfigError if no checkpoint there can be resumed from after all.

    Not launching rests on that checkpoint alone, so it is verified as the ranks would verify it (every file's
    SHA-256 against its manifest) before the run is called done: a damaged one, which the ranks would skip for an
    older one, would otherwise end a requeued job with exit 0 while it has training left. Only that checkpoint
    is hashed, and only then: a run that launches leaves the hashing to its ranks."""
    script = Path(cfg.user_script or "train.py").name
    if cfg.eval_only or not cfg.load or script in INFERENCE_SCRIPTS or script == CLUSTER_CHECK_SCRIPT:
        return None

    def problems(tag_dir: Path) -> list[str]:
        found = screened_file_problems(tag_dir)
        if found or (_iteration(tag_dir) or 0) < cfg.train_iters:
            return found
        return verified_file_problems(tag_dir)

    try:
        tag, _ = newest_usable_tag(cfg.load, problems)
    except CheckpointRefused as error:  # as preflight_problems reports what it refuses
        raise ConfigError(str(error)) from None
    iteration = None if tag is None else _iteration(Path(cfg.load) / tag)
    if iteration is None or iteration < cfg.train_iters:
        return None
    tag_dir = Path(cfg.load) / tag
    return (f"nothing to train: the checkpoint this run resumes ({tag_dir}) is at iteration {iteration} and "
            f"train_iters = {cfg.train_iters}; raise train_iters (and lr_decay_iters, for a longer schedule) to train "
            "on, or set eval_only=true to evaluate it")


def reshard_before_launch(cfg: Config, processes: int) -> str | None:
    """Where the checkpoint a training run resumes was saved on another layout: re-shard it into this one (or
    find it re-sharded) and return the line saying so; None otherwise (megatron/growth/reshard_on_resume.py).
    Asked once preflight_problems found nothing, so its inputs were checked."""
    script = Path(cfg.user_script or "train.py").name
    if not cfg.load or script in INFERENCE_SCRIPTS or script == CLUSTER_CHECK_SCRIPT:
        return None
    try:
        tag, _ = tag_to_resume_before_launch(cfg.load)
    except CheckpointRefused as error:
        raise ConfigError(str(error)) from None
    return resharded_line(config_for_checkpoint(cfg, tag), tag, processes)


def launches_here(cfg: Config, slots: Slots) -> bool:
    """Whether every rank, rank 0's TCPStore on master_port included, runs on this machine."""
    return cfg.launcher == "pdsh" and all(is_local_host(host) for host in slots)


def _master_port_problem(cfg: Config, slots: Slots) -> list[str]:
    if not launches_here(cfg, slots):
        return []  # rank 0 starts on another machine
    if not is_free(master_port(cfg)):
        return [f"master_port {master_port(cfg)} is in use on this machine (another run?); set master_port= to "
                "a free port, or leave it unset for one chosen here"]
    return []


def _cannot_write_in(folder: Path) -> str | None:
    """Why no file can be created in the existing directory `folder`; None if one can."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return error.strerror
    return None


def _directory_problems(key: str, value: str, what: str) -> list[str]:
    """A directory (`key` = `value`) the ranks create and write into but could not: read-only, without
    permission, or under a file; `what` it is, for the fix."""
    path = Path(value).absolute()
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    where = "" if existing == path else f" ({existing}, where it would be created)"
    if not existing.is_dir():
        return [f"{key} = {value}: cannot be a directory{where}: {existing} is a file; choose another {what}"]
    reason = _cannot_write_in(existing)
    if reason:
        return [f"{key} = {value}: not writable{where}: {reason}; choose a writable {what} or fix its permissions"]
    return []


def _output_file_problems(cfg: Config) -> list[str]:
    """generate.py's sample_output_file, which rank 0 opens for writing in a folder that must exist."""
    path = Path(cfg.sample_output_file)
    if path.is_dir():
        return [f"sample_output_file = {path} is a directory; name a file in it, e.g. {path / 'samples.jsonl'}"]
    folder = path.absolute().parent
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    if existing != folder or not folder.is_dir():
        why = f"{existing} is a file" if existing.is_file() else "it does not exist"
        return [f"sample_output_file = {path}: its folder {folder} cannot hold it: {why}; choose another "
                "sample_output_file (or create the folder)"]
    reason = _cannot_write_in(folder)
    if reason:
        return [f"sample_output_file = {path}: its folder {folder} is not writable: {reason}; choose another "
                "sample_output_file or fix the folder's permissions"]
    return []


def _trains_on_a_split(cfg: Config) -> bool:
    """Whether the run trains on the train part of data_path's `split` (not on train_data_paths)."""
    return not cfg.train_data_paths and bool(cfg.data_path) and not cfg.eval_only and cfg.train_iters > 0


def _split_problems(cfg: Config) -> list[str]:
    """A `split` that gives training no documents of data_path, or too little text for one global batch (counted
    from its index)."""
    if not _trains_on_a_split(cfg):
        return []
    idx_path = index_file_path(cfg.data_path)
    try:
        header = read_index_header(idx_path)
        problem = train_split_problem(cfg.data_path, cfg.split, header.num_sequences)
        if problem is None and cfg.train_batch_size:
            problem = train_split_shortfall(cfg.data_path, cfg.split, sequence_sizes(idx_path, header),
                                            cfg.train_batch_size, cfg.seq_length)
    except (OSError, IndexedDatasetError):
        return []  # the dataset check names it
    except ValueError as error:
        return [f"split = {cfg.split!r}: {error}"]
    return [problem] if problem else []


def preflight_notes(cfg: Config) -> list[str]:
    """What deepy.py tells a training run before launch without refusing it: a train split read many times."""
    if not _trains_on_a_split(cfg) or not cfg.train_batch_size:
        return []
    idx_path = index_file_path(cfg.data_path)
    try:
        note = train_split_repeats(cfg.data_path, cfg.split, sequence_sizes(idx_path, read_index_header(idx_path)),
                                   cfg.train_iters, cfg.train_batch_size, cfg.seq_length)
    except (OSError, IndexedDatasetError, ValueError):
        return []  # preflight_problems names it
    return [note] if note else []


def _inference_problems(cfg: Config, slots: Slots) -> list[str]:
    """generate.py's and eval.py's inputs: weights that can be loaded, prompts, lm-eval task names, and where
    generate.py writes its samples (on a launch from this machine)."""
    problems = []
    weights = cfg.eval_ckpt or cfg.load
    problem = weights_location_problem(weights) if weights else None
    if problem:
        problems.append(f"{'eval_ckpt' if cfg.eval_ckpt else 'load'}: {problem}")
    script = Path(cfg.user_script or "").name
    if script == "eval.py" and cfg.eval_tasks:
        problems += eval_task_problems(cfg.eval_tasks, cfg.eval_include_path)
    if script == "generate.py" and launches_here(cfg, slots):
        problems += _output_file_problems(cfg)
    return problems


def _golden_curve_problems(cfg: Config) -> list[str]:
    """The cluster check's golden curve file, which its golden section would otherwise find unusable only after
    the sections before it ran (or, with a NaN in it, pass on every device)."""
    if Path(cfg.user_script or "train.py").name != CLUSTER_CHECK_SCRIPT or "golden" not in cfg.cluster_check_sections:
        return []
    path = Path(cfg.cluster_check_golden or REPOSITORY_CURVE)
    try:
        read_curve(path, args_problem)
    except CurveError as error:
        return [f"cluster_check_golden = {path}: {error}; point it at a file written by python -m "
                "megatron.cluster_check.golden --write FILE"]
    return []


def preflight_problems(cfg: Config, slots: Slots) -> list[str]:
    """Every problem of the run's input files, save directory and port; [] if it can start."""
    vocabulary, problems = _padded_vocabulary(cfg)
    training = Path(cfg.user_script or "train.py").name not in INFERENCE_SCRIPTS
    if training:
        problems += [problem for key, prefix in dataset_prefixes(cfg)
                     for problem in dataset_problems(key, prefix, vocabulary)] or _split_problems(cfg)
        if cfg.save and not cfg.eval_only:
            if launches_here(cfg, slots):
                problems += _directory_problems("save", cfg.save, "save directory")
            try:
                check_save_directory_free(cfg.save)
            except SaveDirectoryInUse as error:
                problems.append(str(error))
        if cfg.log_dir and launches_here(cfg, slots):
            problems += _directory_problems("log_dir", cfg.log_dir, "log_dir")
        if cfg.load:
            problem = load_problem(cfg)
            if problem:
                problems.append(problem)
            elif vocabulary is not None:
                problems += _resume_problems(cfg, vocabulary, world_size(slots))
        else:
            problems += _norm_ramp_problems(cfg, None)
        problems += _golden_curve_problems(cfg)
    else:
        problems += _inference_problems(cfg, slots)
    return problems + _master_port_problem(cfg, slots)
