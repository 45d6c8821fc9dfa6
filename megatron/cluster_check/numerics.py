"""Section 3, numerics of the layout: does the config's tensor x pipeline x data layout compute what one device
computes?

A small TokenFormer of the config's kind (variants.small_model) trains STEPS steps in the config's layout and
the same steps with TP = PP = 1 on the same processes (all data-parallel), in fp32 with TF32 off and
deterministic kernels (training_runs.exact_arithmetic), on the same global batches: every step's loss and
gradient norm must agree within RELATIVE_TOLERANCE (fp32's rounding differs where the layout splits a sum; a
missing or doubled reduction is off by far more). Both then score one held-out global batch. The layout's
engine saves a checkpoint, which tools/grow_checkpoint.py (run by rank 0, as a user runs it) re-shards to TP = 1
without a pipeline; loaded into the TP = 1 engine it must score the same held-out batch within EVAL_TOLERANCE, so
a checkpoint this cluster writes in this layout can be read back in any other.

The checkpoint goes to `save`/cluster_check_scratch (removed afterwards), which the environment section found
shared by every rank; without `save` that part is skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from megatron.checkpoint.save import save_checkpoint
from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.report import FAIL, SectionResult
from megatron.cluster_check.training_runs import batches, engine_for, exact_arithmetic, release
from megatron.cluster_check.variants import batch_split, fp32, small_model, variant
from megatron.formats.deepspeed.resume import load_checkpoint
from megatron.training.step import evaluate

NAME = "numerics"
STEPS = 4
LEARNING_RATE = 1e-3
RELATIVE_TOLERANCE = 1e-3
EVAL_TOLERANCE = 1e-4
SCRATCH = "cluster_check_scratch"
REPOSITORY = Path(__file__).resolve().parents[2]
# Keys a config file for tools/grow_checkpoint.py leaves out: derived again, or set by deepy.py.
_NOT_IN_A_FILE = ("world_size", "train_batch_size", "precision", "lr", "padded_vocab_size", "config_files",
                  "launch_id", "user_script", "master_port")


def _layout_name(cfg) -> str:
    data = cfg.world_size // (cfg.model_parallel_size * max(1, cfg.pipe_parallel_size))
    return f"TP {cfg.model_parallel_size} x PP {cfg.pipe_parallel_size} x DP {data}"


def _train(cfg) -> dict:
    """STEPS steps and the held-out score of `cfg`'s engine; the engine too, for saving or loading into."""
    engine, model_args, step = engine_for(cfg)
    train = batches(cfg, model_args.padded_vocab_size)
    steps = [step(train) for _ in range(STEPS)]
    held_out = batches(cfg, model_args.padded_vocab_size, first_sample=STEPS * cfg.train_batch_size)
    return {"engine": engine, "vocab": model_args.padded_vocab_size, "losses": [loss for loss, _ in steps],
            "grad_norms": [norm for _, norm in steps], "held_out": evaluate(engine, held_out, 1)}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _reshard(layout_cfg, reference_cfg, scratch: Path) -> str | None:
    """Rank 0: tools/grow_checkpoint.py from the layout's checkpoint to the reference's layout; its error, if any
    (broadcast to every rank)."""
    error = None
    if dist.get_rank() == 0:
        target = scratch / "tp1.yml"
        values = {k: v for k, v in reference_cfg.to_dict().items() if k not in _NOT_IN_A_FILE}
        target.write_text(json.dumps(values), encoding="utf-8")  # JSON is YAML
        done = subprocess.run([sys.executable, str(REPOSITORY / "tools" / "grow_checkpoint.py"), "--load",
                               layout_cfg.save, "--save", str(scratch / "tp1"), "--config", str(target)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            error = f"tools/grow_checkpoint.py exited {done.returncode}: {done.stderr.strip()[-500:]}"
    holder = [error]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def run(context: CheckContext, save_shared: bool) -> SectionResult:
    cfg, result = context.cfg, SectionResult(NAME)
    tensor, pipe = cfg.model_parallel_size, cfg.pipe_parallel_size
    micro, accumulation, reference_micro = batch_split(tensor, pipe)
    scratch = Path(cfg.save) / SCRATCH if cfg.save and save_shared else None
    if scratch is not None and dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    # One model and one padded vocabulary (padded to a multiple of the layout's tensor ranks) for both runs.
    common = {**small_model(cfg, tensor, pipe), **fp32(cfg, LEARNING_RATE), "train_iters": STEPS,
              "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by * tensor}
    layout_cfg = variant(cfg, **common, model_parallel_size=tensor, pipe_parallel_size=pipe,
                         train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
                         save=None if scratch is None else str(scratch / "layout"))
    reference_cfg = variant(cfg, **common, model_parallel_size=1, pipe_parallel_size=0,
                            train_micro_batch_size_per_gpu=reference_micro, gradient_accumulation_steps=1,
                            load=None if scratch is None else str(scratch / "tp1"))
    with exact_arithmetic(context.device):
        layout = _train(layout_cfg)
        if scratch is not None:
            save_checkpoint(layout["engine"], layout_cfg, STEPS, STEPS * layout_cfg.train_batch_size)
        release(layout.pop("engine"))
        reference = _train(reference_cfg)
        resharded = None
        if scratch is not None:
            error = _reshard(layout_cfg, reference_cfg, scratch)
            if error:
                result.fail(context.ranks.who(0), f"re-sharding the layout's checkpoint failed: {error}",
                            "run tools/grow_checkpoint.py by hand on that checkpoint to see the whole error")
            else:
                tag = (scratch / "tp1" / "latest").read_text().strip()
                load_checkpoint(reference["engine"], reference_cfg, tag, load_optimizer=False)
                resharded = evaluate(reference["engine"], batches(reference_cfg, reference["vocab"],
                                                                 STEPS * reference_cfg.train_batch_size), 1)
        release(reference.pop("engine"))
    dist.barrier()
    if scratch is not None and dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    name = _layout_name(layout_cfg)
    everyone = context.ranks.name(list(range(context.ranks.world_size)))
    worst = {"loss": 0.0, "gradient norm": 0.0}
    for key, label in (("losses", "loss"), ("grad_norms", "gradient norm")):
        for step, (got, expected) in enumerate(zip(layout[key], reference[key], strict=True), start=1):
            error = _relative(got, expected)
            worst[label] = max(worst[label], error)
            if error > RELATIVE_TOLERANCE:
                result.fail(f"layout {name} ({everyone})", f"step {step} {label} {got:.6g} against {expected:.6g} "
                            f"with TP = PP = 1 (relative {error:.1e} > {RELATIVE_TOLERANCE:g})",
                            "a wrong reduction in this layout or a device computing wrongly: run the check with "
                            "model_parallel_size=1 and then pipe_parallel_size=0 to find which, and report it")
                break
    held_out = _relative(layout["held_out"], reference["held_out"])
    if held_out > RELATIVE_TOLERANCE:
        result.fail(f"layout {name} ({everyone})", f"held-out loss {layout['held_out']:.6g} against "
                    f"{reference['held_out']:.6g} with TP = PP = 1", "as for the training losses above")
    rows = [f"| {step} | {a:.6f} | {b:.6f} | {c:.6g} | {d:.6g} |" for step, (a, b, c, d) in enumerate(
        zip(layout["losses"], reference["losses"], layout["grad_norms"], reference["grad_norms"]), start=1)]
    kernels = "CPU kernels (deterministic)" if context.on_cpu else "deterministic kernels"
    result.figures = [f"A {layout_cfg.num_layers}-layer model of width {layout_cfg.hidden_size}, fp32, TF32 off, "
                      f"{kernels}, {STEPS} steps of {layout_cfg.train_batch_size} sequences of "
                      f"{layout_cfg.seq_length} tokens.", "",
                      f"| step | loss, {name} | loss, TP = PP = 1 | grad norm, {name} | grad norm, TP = PP = 1 |",
                      "|---|---|---|---|---|", *rows, "",
                      f"Largest relative difference: loss {worst['loss']:.1e}, gradient norm "
                      f"{worst['gradient norm']:.1e}, held-out loss {held_out:.1e} (tolerance {RELATIVE_TOLERANCE:g})."]
    checkpoint = "checkpoint not checked: `save` is unset or not shared (environment section)"
    if resharded is not None:
        gap = _relative(resharded, layout["held_out"])
        checkpoint = f"re-sharded checkpoint scores {resharded:.6f} against {layout['held_out']:.6f} ({gap:.1e})"
        if result.status == FAIL:  # the layout's own score is off: the comparison would blame the checkpoint
            checkpoint += ", not judged: the layout's own losses differ"
        elif gap > EVAL_TOLERANCE:
            result.fail(context.ranks.who(0), f"the checkpoint saved in {name}, re-sharded to TP = 1 by "
                        f"tools/grow_checkpoint.py, scores {resharded:.6g} where the layout scored "
                        f"{layout['held_out']:.6g} (relative {gap:.1e} > {EVAL_TOLERANCE:g})",
                        "a checkpoint written in this layout does not read back: report it with this file")
    result.figures.append(f"Checkpoint: {checkpoint} (tolerance {EVAL_TOLERANCE:g}).")
    result.summary = (f"{name} against TP = PP = 1 over {STEPS} steps: loss within {worst['loss']:.1e}, "
                      f"gradient norm within {worst['gradient norm']:.1e}; {checkpoint}")
    return result
