"""The cluster check's golden loss curve file (megatron/cluster_check/golden.py, config key
cluster_check_golden), read and checked field by field before any work is done with it.

Every field is checked because a wrong one does not fail on its own: a comparison with a NaN loss or a NaN
tolerance is never above the tolerance, so such a curve passes every device, and a string where a number
belongs ends in a traceback after the section trained for seconds. deepy.py checks the file before it starts
any process (launch/preflight.py); the golden section and `--write` read it through the same function. The
model's fields are checked by the caller's `model_problem` (megatron.model.args_problem: the config cannot
import the model).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron.cli import InputError

REPOSITORY_CURVE = Path(__file__).parents[1] / "cluster_check" / "golden_curve.json"
CURVE_KEYS = ("model", "optimizer", "data", "steps", "relative_tolerance", "losses")
DATA_COUNTS = ("batch_size", "successors", "vocab_size")  # positive integers, with `seed` (0 or more)
OPTIMIZER_NUMBERS = ("lr", "eps", "weight_decay")


class CurveError(InputError):
    """A curve file that cannot be used, with the reason (the field and its value)."""


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _model_problem(model: Any, model_problem: Callable[[dict], str | None]) -> str | None:
    if not isinstance(model, dict):
        return f"model is {model!r}, not a mapping of TokenFormerArgs' fields"
    problem = model_problem(model)
    return f"model: {problem}" if problem else None


def _optimizer_problem(optimizer: Any) -> str | None:
    if not isinstance(optimizer, dict):
        return f"optimizer is {optimizer!r}, not a mapping of lr, betas, eps and weight_decay"
    for key in OPTIMIZER_NUMBERS:
        if not _is_finite_number(optimizer.get(key)):
            return f"optimizer.{key} is {optimizer.get(key)!r}, not a finite number"
    betas = optimizer.get("betas")
    if not (isinstance(betas, list) and len(betas) == 2 and all(map(_is_finite_number, betas))):
        return f"optimizer.betas is {betas!r}, not a list of two finite numbers"
    return None


def _data_problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return f"data is {data!r}, not a mapping of {', '.join(DATA_COUNTS)} and seed"
    for key in DATA_COUNTS:
        if not (_is_integer(data.get(key)) and data[key] >= 1):
            return f"data.{key} is {data.get(key)!r}, not a positive integer"
    if not (_is_integer(data.get("seed")) and data["seed"] >= 0):
        return f"data.seed is {data.get('seed')!r}, not an integer of 0 or more"
    return None


def _numbers_problem(curve: dict) -> str | None:
    steps, tolerance, losses = curve["steps"], curve["relative_tolerance"], curve["losses"]
    if not (_is_integer(steps) and steps >= 1):
        return f"steps is {steps!r}, not a positive integer"
    if isinstance(tolerance, dict):
        if not tolerance:
            return "relative_tolerance is {}, not a finite number above 0 or a mapping of device types to them"
        for device_type, value in tolerance.items():
            if not (_is_finite_number(value) and value > 0):
                return f"relative_tolerance.{device_type} is {value!r}, not a finite number above 0"
    elif not (_is_finite_number(tolerance) and tolerance > 0):
        return f"relative_tolerance is {tolerance!r}, not a finite number above 0"
    if not isinstance(losses, list) or len(losses) != steps:
        return f"losses holds {len(losses) if isinstance(losses, list) else repr(losses)} values for {steps} steps"
    wrong = [step for step, loss in enumerate(losses, 1) if not (_is_finite_number(loss) and loss > 0)]
    if wrong:
        return (f"losses at step{'s' * (len(wrong) > 1)} {', '.join(map(str, wrong[:5]))}"
                f"{' ...' if len(wrong) > 5 else ''} are not finite numbers above 0 (step {wrong[0]}: "
                f"{losses[wrong[0] - 1]!r})")
    return None


def tolerance_for(curve: dict, device_type: str) -> float | None:
    """The curve's relative tolerance on a device of `device_type` ("cpu", "cuda", ...): its one number, or its
    entry for that type (None: the file has none). Devices round differently (the order of a matrix product's
    sums, the kernels' approximations), so one file can hold a tolerance for each."""
    tolerance = curve["relative_tolerance"]
    return tolerance.get(device_type) if isinstance(tolerance, dict) else tolerance


def curve_problem(curve: Any, model_problem: Callable[[dict], str | None]) -> str | None:
    """What makes `curve` (a parsed file) unusable, naming the field; None if it can be reproduced and compared.
    `model_problem` judges the model's fields (TokenFormerArgs')."""
    missing = [key for key in CURVE_KEYS if not isinstance(curve, dict) or key not in curve]
    if missing:
        return f"is not a curve file: it lacks {', '.join(missing)}"
    for problem in (_numbers_problem(curve), _data_problem(curve["data"]), _optimizer_problem(curve["optimizer"]),
                    _model_problem(curve["model"], model_problem)):
        if problem:
            return problem
    if not isinstance(curve.get("made_with", {}), dict):
        return f"made_with is {curve['made_with']!r}, not a mapping (device, torch, date)"
    return None


def read_curve(path: Path, model_problem: Callable[[dict], str | None]) -> dict:
    """The curve file at `path`; CurveError if it cannot be read or a field is wrong."""
    try:
        curve = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CurveError(f"cannot be read as JSON: {error}") from None
    problem = curve_problem(curve, model_problem)
    if problem:
        raise CurveError(problem)
    return curve
