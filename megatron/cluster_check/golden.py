"""Section 4, the golden loss curve: does every device reproduce losses made elsewhere?

A curve file (JSON) holds a tiny TokenFormer (TokenFormerArgs' fields), its optimizer, its synthetic data
(synthetic.MarkovTokens), the number of steps, a relative tolerance and the losses. Every rank trains that model
alone on its own device, in fp32 with TF32 off and deterministic kernels, and compares each step's loss with the
file's; a rank off by more than the tolerance is named, so one faulty device in a thousand shows. The
repository's curve (golden_curve.json) was made on a CPU; `cluster_check_golden` names another, for example
one made on a machine whose numbers are trusted:

    python -m megatron.cluster_check.golden --write my_curve.json [--from CURVE.json] [--device cuda]

The tolerance covers what differs between devices in fp32: the order of sums inside a matrix product or a
reduction kernel, and the Θ and GeLU kernels' approximations. `relative_tolerance` is one number, or one per device
type ({"cpu": 0.001, "cuda": 0.001}); a device whose type the file does not list fails the section, saying so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from megatron import mpu
from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.ranks import gather
from megatron.cluster_check.report import SectionResult
from megatron.cluster_check.synthetic import MarkovTokens
from megatron.cluster_check.training_runs import exact_arithmetic
from megatron.config.golden_curve import (CURVE_KEYS, REPOSITORY_CURVE, CurveError, curve_problem, read_curve,
                                          tolerance_for)
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.args import args_problem
from megatron.training.optimizer import parameter_groups
from megatron.training.step import lm_loss

NAME = "golden"


def read_curve_file(path: Path) -> dict:
    """The curve file at `path`, every field judged, the model's by TokenFormerArgs (CurveError)."""
    return read_curve(path, args_problem)


def curve_losses(curve: dict, device: torch.device) -> list[float]:
    """The curve's run on `device`, alone (one tensor rank: call with the parallel groups torn down)."""
    args = TokenFormerArgs(**curve["model"])
    data, optimizer = curve["data"], curve["optimizer"]
    samples = MarkovTokens(curve["steps"] * data["batch_size"], args.seq_length, data["vocab_size"], data["seed"],
                           data["successors"])
    with exact_arithmetic(device):
        model = TokenFormerModel(args, device=device)
        adamw = torch.optim.AdamW(parameter_groups(model, optimizer["weight_decay"]), lr=optimizer["lr"],
                                  betas=tuple(optimizer["betas"]), eps=optimizer["eps"], foreach=False)
        losses = []
        for step in range(curve["steps"]):
            rows = range(step * data["batch_size"], (step + 1) * data["batch_size"])
            batch = torch.from_numpy(np.stack([samples[i]["text"] for i in rows])).to(device)
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            adamw.step()
            adamw.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


def run(context: CheckContext) -> SectionResult:
    result = SectionResult(NAME)
    path = Path(context.cfg.cluster_check_golden or REPOSITORY_CURVE)
    try:
        curve = read_curve_file(path)
    except CurveError as error:
        result.fail("cluster_check_golden", f"{path}: {error}",
                    "point cluster_check_golden at a file written by python -m megatron.cluster_check.golden --write")
        result.summary = f"{path}: unusable"
        return result
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()  # each rank alone: one tensor rank
    tolerance, expected = tolerance_for(curve, context.device.type), curve["losses"]
    if tolerance is None:
        result.fail("cluster_check_golden", f"{path} holds no relative_tolerance for {context.device.type} devices "
                    f"(it has {', '.join(curve['relative_tolerance'])})", f"add relative_tolerance.{context.device.type} "
                    "to the file, or make a curve on this kind of device (python -m megatron.cluster_check.golden "
                    "--write FILE --device ...)")
        result.summary = f"{path.name}: no tolerance for {context.device.type}"
        return result
    losses = gather(curve_losses(curve, context.device))
    worst = []
    for rank, got in enumerate(losses):
        errors = [abs(g - e) / abs(e) if math.isfinite(g) else math.inf for g, e in zip(got, expected, strict=True)]
        worst.append(max(errors))
        first = next((step for step, error in enumerate(errors) if error > tolerance), None)
        if first is not None:
            result.fail(context.ranks.who(rank), f"step {first + 1} loss {got[first]:.6f} against the curve's "
                        f"{expected[first]:.6f} (relative {errors[first]:.1e} > {tolerance:g}; largest "
                        f"{worst[-1]:.1e})", "if every rank differs alike, the curve was made with other software "
                        "or settings (make one here: python -m megatron.cluster_check.golden --write FILE, and set "
                        "cluster_check_golden); if some ranks differ, their devices compute wrongly: drain them")
    steps = len(expected)
    show = sorted({0, 1, 4, 9, steps - 1} & set(range(steps)))
    result.figures = [f"Curve: {path} ({curve.get('made_with', {}).get('device', 'unknown device')}, "
                      f"{steps} steps, tolerance {tolerance:g} relative on {context.device.type}).", "",
                      "| step | " + " | ".join(str(s + 1) for s in show) + " |", "|---|" + "---|" * len(show),
                      "| curve | " + " | ".join(f"{expected[s]:.4f}" for s in show) + " |",
                      "| rank 0 | " + " | ".join(f"{losses[0][s]:.4f}" for s in show) + " |", "",
                      f"Largest relative difference over all ranks: {max(worst):.1e} "
                      f"({context.ranks.who(max(range(len(worst)), key=worst.__getitem__))})."]
    result.summary = (f"{len(losses)} device(s) reproduce {path.name}'s {steps} losses within {max(worst):.1e} "
                      f"(tolerance {tolerance:g})")
    return result


def make_curve(template: dict, device: torch.device) -> dict:
    """`template`'s run on `device`, as a new curve file's content; CurveError if the run's losses are not a
    curve (a NaN loss, which every later comparison would pass)."""
    curve = {key: template[key] for key in CURVE_KEYS if key != "losses"}
    curve["losses"] = curve_losses(curve, device)
    problem = curve_problem(curve, args_problem)
    if problem:
        raise CurveError(f"the run on {device} gave no usable curve: {problem}")
    curve["made_with"] = {"device": str(device), "torch": torch.__version__,
                          "date": datetime.date.today().isoformat()}
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a golden loss curve for the cluster check.")
    parser.add_argument("--write", required=True, type=Path, help="the curve file to write")
    parser.add_argument("--from", dest="template", type=Path, default=REPOSITORY_CURVE,
                        help="the curve whose model, data and steps to run (default: the repository's)")
    parser.add_argument("--device", default="cpu", help="where to run it (cpu, cuda, ...)")
    options = parser.parse_args()
    try:
        template = read_curve_file(options.template)
    except CurveError as error:
        sys.exit(f"golden: --from {options.template}: {error}")
    try:
        curve = make_curve(template, torch.device(options.device))
    except CurveError as error:
        sys.exit(f"golden: {error}; nothing written to {options.write}")
    options.write.write_text(json.dumps(curve, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {options.write}: {curve['steps']} losses from {curve['losses'][0]:.4f} to {curve['losses'][-1]:.4f}")


if __name__ == "__main__":
    main()
