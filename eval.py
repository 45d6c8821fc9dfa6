#!/usr/bin/env python
"""Score a trained TokenFormer on lm-evaluation-harness tasks; started by deepy.py on every rank:

    python deepy.py eval.py configs/demo.yml configs/eval.yml [eval_tasks=[piqa,hellaswag] ...]

Loads the checkpoint in `load`, splits it over model_parallel_size processes (num_gpus must equal
model_parallel_size), runs `eval_tasks` (lm-eval task names, plus the task YAML files of eval_include_path)
in batches of train_micro_batch_size_per_gpu, and writes lm-eval's results as JSON to
EVAL_RESULTS_PREFIX_eval_results.json. Needs the eval extra: pip install -r requirements/requirements-eval.txt.
Offline use and local copies of the task datasets: docs/inference.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron.host.startup import collector_paused

with collector_paused():  # torch and DeepSpeed: 400,000 objects (megatron/host/startup.py)
    from megatron.config import Config
    from megatron.config.eval_tasks import task_manager
    from megatron.inference import load_model
    from megatron.runtime.collectives import is_output_rank
    from megatron.runtime.entry import run_rank
    from megatron.runtime.process_group import initialize_distributed
    from megatron.tokenizer import build_tokenizer


def results_path(cfg: Config) -> Path:
    return Path(f"{cfg.eval_results_prefix}_eval_results.json" if cfg.eval_results_prefix else "eval_results.json")


def main(cfg: Config) -> dict:
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from megatron.inference.lm_eval_adapter import TokenFormerLM

    device = initialize_distributed(cfg).device
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)
    model = load_model(cfg.eval_ckpt or cfg.load, cfg, device)
    lm = TokenFormerLM(model, tokenizer, batch_size=cfg.train_micro_batch_size_per_gpu, seed=cfg.seed, device=device)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=cfg.eval_tasks, task_manager=task_manager(cfg.eval_tasks, cfg.eval_include_path),
        log_samples=False, random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed)
    results = json.loads(json.dumps(results, default=handle_non_serializable))
    if is_output_rank():
        results_path(cfg).write_text(json.dumps(results, indent=2), encoding="utf-8")
        print(f"results for {', '.join(cfg.eval_tasks)}: {json.dumps(results['results'], indent=2)}\n"
              f"written to {results_path(cfg)}", flush=True)
    return results


if __name__ == "__main__":
    run_rank(main, __doc__)
