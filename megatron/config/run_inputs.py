"""Checks of a built Config against the files and the device, done when a run starts.

validate.py holds the rules config.py applies while it builds a Config; these take the built Config, so they
live apart: config.py imports validate.py, this module imports both, and neither imports back.
"""

from __future__ import annotations

from pathlib import Path

from megatron.config.config import Config
from megatron.config.validate import raise_if_any
from megatron.data.indexed_dataset import prefix_hint


def _missing_dataset_files(key: str, prefix: str) -> str | None:
    missing = [f"{prefix}{suffix}" for suffix in (".bin", ".idx") if not Path(f"{prefix}{suffix}").is_file()]
    if missing:
        return f"{key} = {prefix!r}: missing {', '.join(missing)}; {prefix_hint(prefix)}"
    return None


def dataset_prefixes(cfg: Config) -> list[tuple[str, str]]:
    """(config key, PREFIX) of every dataset the run reads, e.g. ("train_data_paths[0]", "data/a_text_document")."""
    prefixes = [("data_path", cfg.data_path)] if cfg.data_path else []
    for name in ("train_data_paths", "valid_data_paths", "test_data_paths"):
        prefixes += [(f"{name}[{i}]", prefix) for i, prefix in enumerate(getattr(cfg, name) or ())]
    return prefixes


def _data_problems(cfg: Config) -> list[str]:
    needed = "valid_data_paths" if cfg.eval_only else "train_data_paths"
    if not cfg.data_path and not getattr(cfg, needed):
        return [f"no data: set data_path (the PREFIX of PREFIX.bin/PREFIX.idx) or {needed}"]
    return [problem for key, prefix in dataset_prefixes(cfg) if (problem := _missing_dataset_files(key, prefix))]


_TOKENIZER_FILES = {
    "HFTokenizer": ("vocab_file",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SPMTokenizer": ("vocab_file",),
    "CharLevelTokenizer": (),
}


def _tokenizer_problems(cfg: Config) -> list[str]:
    problems = []
    for key in _TOKENIZER_FILES[cfg.tokenizer_type]:
        if getattr(cfg, key) is None:
            problems.append(f"{key} is not set but tokenizer_type {cfg.tokenizer_type} needs it")
    for key in ("vocab_file", "merge_file"):
        path = getattr(cfg, key)
        if path is not None and not Path(path).is_file():
            problems.append(f"{key} = {path!r} does not exist")
    return problems


def _checkpoint_problems(cfg: Config) -> list[str]:
    problems = []
    if cfg.eval_only and (cfg.load is None or not Path(cfg.load).is_dir()):
        problems.append(f"eval_only needs load to be an existing checkpoint directory; load = {cfg.load!r}")
    if cfg.pretrain_partial_init is not None and not Path(cfg.pretrain_partial_init).is_dir():
        problems.append(
            f"pretrain_partial_init = {cfg.pretrain_partial_init!r} is not a directory; point it at the `save` "
            "directory of the smaller model's run (or one global_stepN directory in it)"
        )
    return problems


def _precision_problems(cfg: Config, device_name: str) -> list[str]:
    if cfg.precision == "fp16" and device_name == "cpu":
        return ["fp16 is enabled but the device is CPU, which has no fp16 training; "
                "use bf16={enabled: true} with fp16={enabled: false}, or fp16={enabled: false} for fp32"]
    return []


# Scripts that run a trained model instead of training one (docs/inference.md): they read `load`, not the data.
INFERENCE_SCRIPTS = ("generate.py", "eval.py")
# The cluster check (docs/cluster.md): checked as a training run is, since it checks that run's inputs, but it
# trains nothing of its own and never resumes.
CLUSTER_CHECK_SCRIPT = "cluster_check.py"
CLUSTER_CHECK_FAILED = 3  # its exit status when a section failed: a verdict on the cluster, not an error
HUNG = 124  # a rank's exit status when the job hung (runtime/hang_watch.py): distinct from a crash's 1


def _inference_problems(cfg: Config, script: str) -> list[str]:
    problems = []
    if cfg.world_size is not None and cfg.world_size != cfg.model_parallel_size:
        problems.append(f"{script} runs one model replica on model_parallel_size={cfg.model_parallel_size} processes, "
                        f"but {cfg.world_size} would start: set num_gpus={cfg.model_parallel_size}")
    weights = cfg.eval_ckpt or cfg.load
    if weights is None or not Path(weights).exists():
        problems.append(f"{script} needs load (a checkpoint directory) or eval_ckpt (a weights file) to exist; "
                        f"load = {cfg.load!r}, eval_ckpt = {cfg.eval_ckpt!r}")
    if script == "generate.py" and cfg.text_gen_type == "input-file":
        if cfg.sample_input_file is None or not Path(cfg.sample_input_file).is_file():
            problems.append(f"text_gen_type input-file needs sample_input_file = an existing file of prompts; "
                            f"sample_input_file = {cfg.sample_input_file!r}")
        elif not any(prompt.strip() for prompt in Path(cfg.sample_input_file).read_text(
                encoding="utf-8", errors="surrogateescape").split(cfg.prompt_end)):
            problems.append(f"sample_input_file = {cfg.sample_input_file!r} holds no prompts (it is empty or blank), "
                            "so nothing would be generated; write one prompt per line (prompt_end separates them)")
    if script == "eval.py" and not cfg.eval_tasks:
        problems.append("eval.py needs eval_tasks, e.g. eval_tasks=[lambada_openai,piqa]")
    if script == "eval.py" and cfg.eval_include_path is not None and not Path(cfg.eval_include_path).is_dir():
        problems.append(f"eval_include_path = {cfg.eval_include_path!r} is not a directory of task YAML files")
    return problems


def check_run_inputs(cfg: Config, device_name: str | None = None) -> None:
    """Checks that need the files and the device, done when a run starts.

    `device_name` is the accelerator's name ('cpu', 'cuda', ...); by default it
    is asked from DeepSpeed. Raises one ConfigError listing every problem.
    """
    if device_name is None:
        from deepspeed.accelerator import get_accelerator

        device_name = get_accelerator().device_name()
    script = Path(cfg.user_script or "train.py").name
    if script in INFERENCE_SCRIPTS:
        raise_if_any(_tokenizer_problems(cfg) + _inference_problems(cfg, script))
        return
    raise_if_any(
        _data_problems(cfg)
        + _tokenizer_problems(cfg)
        + _checkpoint_problems(cfg)
        + _precision_problems(cfg, device_name)
    )
