"""Draw one or more runs' metrics.jsonl into one PNG: loss (train and validation), learning rate, throughput.

    python tools/plot_metrics.py demo_run/logs [other_run/logs ...] [--out metrics.png]

RUN is a run's log_dir (holding metrics.jsonl) or the file itself; each run is one colour, labelled by its
directory, validation dashed. Needs matplotlib (requirements-dev.txt). A problem is one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from megatron.cli import InputError, one_line_errors

PANELS = (("lm_loss", "loss"), ("lr", "learning rate"), ("tokens_per_sec", "tokens/s"))


def read_run(path: Path) -> list[dict]:
    """The records of a run's metrics.jsonl (`path`: the file or its directory); InputError naming a problem. A
    last line without its newline that is not JSON is left out: a run killed (or still) writing it."""
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"{path} holds no metrics.jsonl: pass a run's log_dir")
    records = []
    text = file.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):  # no newline after it: a record cut short by a kill (or being written)
                    break
                raise InputError(f"{file} line {number} is not JSON") from None
    if not records:
        raise InputError(f"{file} is empty: the run logged nothing yet")
    return records


def label_of(path: Path) -> str:
    """A run's name: its log_dir's path, less a trailing `logs`."""
    directory = path if path.is_dir() else path.parent
    return str(directory.parent if directory.name == "logs" else directory)


def plot(runs: dict[str, list[dict]]):
    """The figure: one panel per PANELS entry, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for index, (label, records) in enumerate(runs.items()):
        colour = f"C{index % 10}"
        for axis, (key, title) in zip(axes, PANELS):
            for split, style in (("train", "-"), ("valid", "--")):
                points = [(r["iteration"], r[key]) for r in records
                          if r.get("split") == split and r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    axis.plot(steps, values, style, color=colour, label=f"{label} ({split})" if key == "lm_loss"
                              else label)
            axis.set_title(title)
            axis.set_xlabel("iteration")
    axes[0].legend(fontsize="small")
    return figure


@one_line_errors("plot_metrics.py")
def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="log_dir of a run (or its metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("metrics.png"), help="the PNG to write (metrics.png)")
    args = parser.parse_args(argv)
    runs = {label_of(path): read_run(path) for path in args.runs}
    figure = plot(runs)
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}: {', '.join(runs)}")
    return args.out


if __name__ == "__main__":
    main()
