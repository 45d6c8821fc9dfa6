"""The pause of a growth inside the running job (growth_schedule) against a save plus a load of the same model.

    .venv/bin/python -m benchmarks.online_growth [--config configs/150M.yml] [--factor 2] [--workdir DIR]

One process (fp32 on a CPU, the config's layout on one rank, 256-token sequences, micro-batch 1, synthetic data
with GPT-NeoX's vocabulary size) trains one iteration of --config, saves it (the checkpoint before growth that
both paths write), and grows every slot count by --factor inside the run: the pause is what the run's growth
record says (reading that checkpoint back, building the engine at the new counts, growing into it). Then the
grown model is saved and a new Trainer loads it, which is what a stop and restart costs in one process, before
a new job's launch, imports and rendezvous, and before the grow tool's own read and write. The last line is
the pause over the save plus the load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ON_CPU = ["fp16={enabled: false}", "seq_length=256", "train_micro_batch_size_per_gpu=1",
          "gradient_accumulation_steps=1", "train_batch_size=1", "num_gpus=1", "eval_iters=0", "eval_interval=1000",
          "checkpoint_factor=1000", "train_iters=3", "lr_decay_iters=3", "tokenizer_type=HFTokenizer", "compile=null"]


def overrides(options, data: Path, tokenizer: Path, save: Path, *extra: str) -> list[str]:
    return [*ON_CPU, f"data_path={data}", f"vocab_file={tokenizer}", f"save={save}", f"load={save}",
            f"log_dir={save}/logs", *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "150M.yml")
    parser.add_argument("--factor", type=float, default=2, help="every slot count is multiplied by this (rounded to "
                        "a multiple of 64)")
    parser.add_argument("--workdir", type=Path, default=None, help="where data and checkpoints go (default: a "
                        "temporary folder, deleted at the end)")
    options = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29671", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    from benchmarks.synthetic_data import write_training_data
    from megatron.checkpoint.save import save_checkpoint
    from megatron.config import load_config
    from megatron.model.spec import slot_keys
    from megatron.training.pretrain import Trainer

    work = options.workdir or Path(tempfile.mkdtemp(prefix="online_growth_"))
    try:
        data, tokenizer = write_training_data(work / "data", documents=60)
        base = load_config([options.config], overrides(options, data, tokenizer, work / "online"), world_size=1)
        grown = {key: round(getattr(base, key) * options.factor / 64) * 64 for key in slot_keys()}
        schedule = "growth_schedule=[{iteration: 1, " + ", ".join(f"{k}: {v}" for k, v in grown.items()) + "}]"
        trainer = Trainer(load_config([options.config], overrides(options, data, tokenizer, work / "online",
                                                                  schedule), world_size=1))
        parameters = sum(p.numel() for p in trainer.engine.module.parameters())
        started = time.perf_counter()
        trainer.train(until=1)  # one iteration and the checkpoint before growth
        first = time.perf_counter() - started
        trainer.train(until=2)  # grows, then one iteration of the grown model
        record = next(json.loads(line) for line in (work / "online" / "logs" / "metrics.jsonl").read_text().splitlines()
                      if json.loads(line)["split"] == "growth")
        grown_parameters = sum(p.numel() for p in trainer.engine.module.parameters())
        print(f"{options.config.name} on one CPU process, fp32: {parameters / 1e6:,.0f}M -> "
              f"{grown_parameters / 1e6:,.0f}M parameters ({', '.join(f'{k} {v}' for k, v in grown.items())}); "
              f"first iteration and save {first:.1f} s")
        print(f"{'step':<58} {'seconds':>8}")
        row("growth inside the run (read back, rebuild, grow)", record["seconds"])
        started = time.perf_counter()
        save_checkpoint(trainer.engine, trainer.cfg, 2, trainer.state.consumed_samples, trainer.growth.record_to_save())
        save = row("save of the grown model", time.perf_counter() - started)
        del trainer
        gc.collect()
        target = [f"{key}={value}" for key, value in grown.items()]
        started = time.perf_counter()
        Trainer(load_config([options.config], [*overrides(options, data, tokenizer, work / "online", *target),
                                               f"save={work / 'restarted'}"], world_size=1))
        load = row("a new Trainer loading it (engine, data, load)", time.perf_counter() - started)
    finally:
        if options.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"pause / (save + load) = {record['seconds'] / (save + load):.2f}")


def row(step: str, seconds: float) -> float:
    """Printed as soon as measured: a larger model may not survive the next step (the load's peak memory)."""
    print(f"{step:<58} {seconds:>8.1f}", flush=True)
    return seconds


if __name__ == "__main__":
    main()
