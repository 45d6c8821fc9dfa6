"""One command for a borrowed GPU machine: check and measure every GPU path, in at most 8 minutes on one H100.

    python3 -m benchmarks.gpu_check [--kit .gpu-kit] [--out DIR] [--skip STEP ...] [--cpu-plumbing]

Made for a machine with CUDA, torch and Triton but no DeepSpeed and no network: `make gpu-kit` here writes the
wheels it lacks into .gpu-kit/, which travels with the checkout. Steps, each timed, each free to fail without
stopping the rest, each in the report:

    kit          the kit's wheels installed into a temporary site folder, first on the path of this process and
                 of every command below (benchmarks/gpu_kit.py)
    environment  device, memory, driver, Python, torch, CUDA, Triton and DeepSpeed versions, and the two
                 ceilings measured: a bf16 8192³ GEMM's TFLOP/s and a device-to-device copy's GB/s (in a process
                 of its own, so that no later step shares the card with its buffers)
    kernels      benchmarks.gpu_pattention --no-steps --profile --blocks-sweep: fused, flash (its blocks, auto's
                 choice) and flash's opt-in Triton kernels (l2 Θ, flash_backend: kernels) forward+backward against
                 the six GEMMs at the paper configs' shapes, 16k tokens, with their peak memory over fused's, the
                 kernels each launches a call, flash's blocks (softmax) with the input rows in 2 to 16 blocks, and
                 the profiler's kernel table of each at the 1-5B FFN shape (the kernels' tile sweep, --tiles-sweep,
                 is left to a run of its own: at 44x fused's time in training they cost minutes)
    training     python deepy.py train.py configs/1-5B.yml at 4 layers (full width and vocabulary), one GPU,
                 NCCL, DeepSpeed ZeRO-1, bf16, micro-batch 8 of 2048 tokens, on data and a 50,277-token
                 tokenizer made here: flash and fused for 30 iterations each, whose tokens/s, TFLOP/s per GPU, MFU
                 and peak memory come from the runs' metrics.jsonl (medians after 5 warm-up iterations);
                 flash's tokens/s over fused's is a target. (Bitwise resume under `deterministic: true` held on
                 the H100, gpu_reports/2026-11-27-h100-gpu_check.md; the tests check it on the CPU.)
    gpu-tests    pytest -m gpu: compiled Triton flash against plain, the model on CUDA against the CPU
    max-batch    benchmarks.max_micro_batch: the largest micro-batch of the full 1-5B config at sequence 2048,
                 fused and flash, against the memory model's prediction
    cluster-check  cluster_check.py's one-device sections (environment, golden, throughput) through deepy.py on
                 configs/1-5B.yml at the training runs' depth: the golden curve reproduced on the device, tokens/s,
                 MFU and peak memory against the memory model at its micro-batch (docs/cluster.md)
    framework    the one-GPU sweep that sets the engine's defaults (issue 47): benchmarks.framework_step at
                 configs/1-5B.yml's own depth, fused, bf16, micro-batch 8 where the memory model fits it on the
                 card, one process each, in this order while the check's 8 minutes last (run last, it gets the
                 time the others leave, at least a minute): deepy.py's step (the lean step, eager layers: the
                 MFU target), plain+masters (the same recipe in a plain loop: the ratio target's denominator),
                 deepy.py's step at DP 2 (two processes on the one device over gloo: the lean DP step's code on
                 CUDA tensors), each layer compiled, DeepSpeed's step (lean_step false),
                 the plain loop (reported beside), the config's checkpoint_activations (MFU and HFU); the
                 breakdown of each step by phase and the decision table of the levers
    report       gpu_check.json and gpu_check.md under --out (default $OUT, else ./gpu_check_out), the targets of
                 issues 39 and 40 met or missed, and a short table printed last

Without CUDA it says so on one line and exits 2. --cpu-plumbing runs the same steps on a CPU at toy sizes
(tests/test_gpu_check.py): the kit install, the data, the deepy.py launches, the log parsing, the resume check
and the report are then known to work before a minute of GPU time is spent; the GPU-only measurements say
"unavailable" there. Exit status 0 when no step failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.synthetic_data import write_training_data

REPO = Path(__file__).resolve().parents[1]
REDUCED_DEPTH = 4  # layers of the training step's runs (full width and vocabulary)
UNAVAILABLE_EXIT = 2
WARMUP_ITERATIONS = 5
# the framework step's variants in the order its budget runs them (benchmarks/framework_step.py)
FRAMEWORK_VARIANTS = ("framework", "plain+masters", "framework-dp2", "framework+compile", "framework-deepspeed",
                      "plain", "framework+recompute")  # third: the lean DP step's code on CUDA tensors, never cut
WALL_BUDGET_S = 480  # the whole check's, on one H100 or H200: a 15-minute lease with a rerun's margin
# About one full-depth framework variant's run: the sweep, run last, starts variants until this much is left of
# WALL_BUDGET_S (the last one started still runs), and gets at least this much whatever the others took.
FRAMEWORK_VARIANT_S = 60
KIT_PYTHON = (3, 12)  # the GPU machine's, for which benchmarks/gpu_kit.py fetches the compiled wheels
TARGETS = {  # issues 39 and 40's targets, checked in the report
    "framework / plain+masters tokens/s": (">=", 0.97),
    "training MFU (configs/1-5B.yml, full depth)": (">=", 0.45),
    "flash / six GEMMs at 1-5B shapes": ("<=", 1.6),
    "flash / fused training tokens/s (4 layers)": (">=", 0.85),
    "flash / fused peak memory at n >= 4d": ("<=", 0.35),
    "largest micro-batch flash / fused": (">=", 1.5),
    "script wall time (s)": ("<=", 480.0),
}


@dataclasses.dataclass
class StepResult:
    name: str
    status: str = "ok"  # ok | failed | unavailable | skipped
    seconds: float = 0.0
    summary: str = ""
    details: dict = dataclasses.field(default_factory=dict)


class Check:
    """The state the steps share: options, the work folder, the environment of child processes."""

    def __init__(self, options: argparse.Namespace):
        self.options = options
        self.cpu = options.cpu_plumbing
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.results: list[StepResult] = []
        self.started = time.perf_counter()

    def seconds_left(self) -> float:
        return WALL_BUDGET_S - (time.perf_counter() - self.started)

    def run(self, command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """A child process of this check (its environment, the repository as working folder), output kept."""
        return subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=False, **kwargs)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# --- steps ---------------------------------------------------------------------------------------------------

def step_kit(check: Check, result: StepResult) -> None:
    from benchmarks.gpu_kit import install

    kit = check.options.kit
    if kit is None:
        result.status, result.summary = "skipped", "no --kit: the packages installed here are used"
        return
    site = install(Path(kit), check.work / "site")
    wheels = sorted(path.name for path in Path(kit).glob("*.whl"))
    result.details = {"wheels": wheels, "site": str(site)}
    if sys.version_info[:2] != KIT_PYTHON:  # its compiled wheels would not load: install checked, path kept
        result.summary = (f"{len(wheels)} wheels installed into {site}, not put on the path: they are for Python "
                          f"{'.'.join(map(str, KIT_PYTHON))}, this is {sys.version.split()[0]}")
        return
    sys.path.insert(0, str(site))
    check.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), check.env.get("PYTHONPATH")]))
    result.summary = f"{len(wheels)} wheels into {site}, first on the path"


def _fastest_seconds(fn: Callable[[], None], synchronize: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def environment_details(cpu: bool) -> dict:
    """Versions, the device, and the bf16 GEMM and copy ceilings measured on it."""
    import torch

    details = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for module in ("triton", "deepspeed"):
        try:
            details[module] = __import__(module).__version__
        except ImportError as error:
            details[module] = f"not importable ({error})"
    if cpu:
        device, dtype, size, copy_bytes = torch.device("cpu"), torch.float32, 1024, 2**26
        details.update(device="cpu", memory_gib=None, driver=None)
        synchronize = lambda: None  # noqa: E731
    else:
        device, dtype, size, copy_bytes = torch.device("cuda"), torch.bfloat16, 8192, 2**31
        properties = torch.cuda.get_device_properties(0)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False)
        details.update(device=properties.name, memory_gib=properties.total_memory / 2**30,
                       multiprocessors=properties.multi_processor_count,
                       driver=smi.stdout.strip() or f"unknown (nvidia-smi: {tail(smi.stderr, 1)})")
        synchronize = torch.cuda.synchronize
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    gemm = _fastest_seconds(lambda: [a @ b for _ in range(5)], synchronize, 5) / 5
    source = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    copy = _fastest_seconds(lambda: target.copy_(source), synchronize, 10)
    details["gemm_tflops"] = 2 * size**3 / gemm / 1e12
    details["gemm"] = f"{str(dtype).removeprefix('torch.')} {size}³"
    details["copy_gb_per_s"] = 2 * copy_bytes / copy / 1e9  # bytes read + written
    return details


def step_environment(check: Check, result: StepResult) -> None:
    """environment_details in a process of its own: its GEMM and copy buffers, and its CUDA context, are gone
    before any later step runs, so each of those has the whole card."""
    out = check.work / "environment.json"
    done = check.run([sys.executable, "-m", "benchmarks.gpu_check", "--environment-json", str(out),
                      *(["--cpu-plumbing"] if check.cpu else [])], timeout=120)
    if done.returncode != 0:
        result.status, result.summary = "failed", tail(done.stderr, 5)
        return
    details = result.details = json.loads(out.read_text())
    memory = "" if details["memory_gib"] is None else f", {details['memory_gib']:.0f} GiB"
    result.summary = (f"{details['device']}{memory}; torch {details['torch']}, Triton {details['triton']}, "
                      f"DeepSpeed {details['deepspeed']}; {details['gemm']} GEMM {details['gemm_tflops']:.1f} "
                      f"TFLOP/s, copy {details['copy_gb_per_s']:.0f} GB/s")


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line ("3 passed, 1 skipped in 2.0s")."""
    return {word: int(count) for count, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                          output.strip().splitlines()[-1] if output.strip() else "")}


def step_gpu_tests(check: Check, result: StepResult) -> None:
    done = check.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider"],
                     timeout=240)
    counts = pytest_counts(done.stdout)
    result.details = {"counts": counts, "returncode": done.returncode, "output": tail(done.stdout, 30)}
    result.summary = ", ".join(f"{n} {word}" for word, n in counts.items()) or tail(done.stdout + done.stderr, 3)
    if done.returncode != 0:
        result.status = "failed"
    elif not counts.get("passed"):
        result.status = "unavailable"


def largest_config_rows(rows: list[dict]) -> list[dict]:
    """The kernel rows of the 1-5B config's shapes, where issue 26's time target is set."""
    return [r for r in rows if r["name"].startswith("1-5B")]


def run_benchmark(check: Check, result: StepResult, module: str, arguments: list[str],
                  timeout: float) -> tuple[dict, str] | None:
    """`python -m module ARGS --json FILE`: (its JSON, its output), or None with the result marked unavailable
    (exit 2: no CUDA) or failed."""
    report = check.work / f"{module.rsplit('.', 1)[-1]}.json"
    done = check.run([sys.executable, "-m", module, *arguments, "--json", str(report)], timeout=timeout)
    if done.returncode == 0:
        return json.loads(report.read_text()), done.stdout
    result.status = "unavailable" if done.returncode == UNAVAILABLE_EXIT else "failed"
    result.summary = tail(done.stderr, 1 if done.returncode == UNAVAILABLE_EXIT else 5)
    return None


def step_kernels(check: Check, result: StepResult) -> None:
    ran = run_benchmark(check, result, "benchmarks.gpu_pattention",
                        ["--no-steps", "--profile", "--blocks-sweep", "--repeats", "5"], 240)
    if ran is None:
        return
    data, output = ran
    largest = largest_config_rows(data["kernels"])
    wide = [r for r in data["kernels"] if r["n"] >= 4 * r["d"]]
    data["flash_over_gemms_1_5B"] = sum(r["flash"] for r in largest) / sum(r["gemms"] for r in largest)
    data["peak_flash_over_fused_n_ge_4d"] = max(r["peak"] for r in wide)
    data["table"] = tail(output.split("flash, l2_norm_gelu")[0], 60)
    result.details = data
    launches = "; ".join(f"{r['norm']} launches " + ", ".join(f"{name} {sum(r[name].values())}"
                                                              for name in ("flash", "kernels", "fused"))
                         for r in data.get("launches", []))
    result.summary = (f"flash / six GEMMs: {data['flash_over_gemms']:.2f} overall, "
                      f"{data['flash_over_gemms_1_5B']:.2f} at 1-5B shapes; flash / fused peak memory at n >= 4d "
                      f"<= {data['peak_flash_over_fused_n_ge_4d']:.2f}; {launches}")


def training_overlay(check: Check, data: Path, tokenizer: Path, iterations: int) -> Path:
    """The YAML laid over configs/1-5B.yml: reduced depth (on a CPU, a toy model), one
    process, bf16 on the GPU (fp32 on a CPU), the check's data, no periodic saves or long evaluations."""
    if check.cpu:
        model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "qkv_slot_num": 64,
                 "proj_slot_num": 64, "ffn_slot_num": 256, "seq_length": 64, "max_position_embeddings": 64,
                 "fp16": {"enabled": False}, "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2}
    else:
        model = {"fp16": {"enabled": False}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 8,
                 "train_batch_size": 8, "num_layers": REDUCED_DEPTH}
    overlay = {**model, "num_gpus": 1, "gradient_accumulation_steps": 1, "checkpoint_activations": False,
               "train_iters": iterations, "lr_decay_iters": iterations, "warmup": 0.1,
               "data_path": str(data), "vocab_file": str(tokenizer), "tokenizer_type": "HFTokenizer",
               "split": "990,10,0", "eval_interval": 100000, "eval_iters": 1, "log_interval": 1,
               "checkpoint_factor": 100000, "extra_save_iters": None, "keep_last_n_checkpoints": None}
    path = check.work / f"overlay{'_cpu' if check.cpu else ''}.yml"
    path.write_text(json.dumps(overlay))  # JSON is YAML
    return path


def deepy_command(overlay: Path, overrides: list[str], log_dir: Path) -> list[str]:
    """deepy.py training configs/1-5B.yml under `overlay` and `overrides`, logging to `log_dir`, on a free port."""
    from tests.distributed import free_port

    return [sys.executable, "deepy.py", "train.py", "configs/1-5B.yml", str(overlay), *overrides,
            f"log_dir={log_dir}", f"master_port={free_port()}"]


def read_train_records(log_dir: Path) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["split"] == "train"]


def run_summary(records: list[dict]) -> dict:
    """Medians after the warm-up iterations (or the last half, in a short run); the peak memory's maximum."""
    steady = [r for r in records if r["iteration"] > WARMUP_ITERATIONS] or records[len(records) // 2:]
    median = lambda key: None if steady[0][key] is None else statistics.median(r[key] for r in steady)  # noqa: E731
    return {"iterations": len(records), "tokens_per_sec": median("tokens_per_sec"),
            "tflops_per_device": median("tflops_per_device"), "mfu": median("mfu"),
            "peak_memory_gib": max(r["peak_memory_bytes"] for r in records) / 2**30,
            "losses": {r["iteration"]: r["lm_loss"] for r in records}}


def step_training(check: Check, result: StepResult) -> None:
    """Throughput of flash and fused as users run them, and the two runs' losses side by side."""
    iterations = 8 if check.cpu else 30
    data, tokenizer = write_training_data(check.work / "data")
    overlay = training_overlay(check, data, tokenizer, iterations)
    summaries = {}
    for name in ("flash", "fused"):
        log_dir = check.work / "logs" / name
        done = check.run(deepy_command(overlay, [f"pattention_impl={name}"], log_dir),
                         timeout=150 if not check.cpu else 300)
        if done.returncode != 0:
            result.status = "failed"
            result.summary = f"{name}: deepy.py exited {done.returncode}"
            result.details = {"run": name, "output": tail(done.stdout + "\n" + done.stderr, 40)}
            return
        summaries[name] = run_summary(read_train_records(log_dir))
    flash, fused = summaries["flash"], summaries["fused"]
    fused_gap = max(abs(fused["losses"][i] - flash["losses"][i]) / abs(flash["losses"][i]) for i in flash["losses"])
    result.details = {"runs": {k: {**v, "losses": {str(i): x for i, x in v["losses"].items()}}
                               for k, v in summaries.items()},
                      "fused_vs_flash_max_relative_loss_gap": fused_gap}
    mfu = lambda s: "no MFU" if s["mfu"] is None else f"MFU {s['mfu']:.1%}"  # noqa: E731
    result.summary = (f"flash {flash['tokens_per_sec']:,.0f} tok/s {flash['tflops_per_device']:.3g} TFLOP/s "
                      f"{mfu(flash)} {flash['peak_memory_gib']:.1f} GiB; fused {fused['tokens_per_sec']:,.0f} tok/s "
                      f"{fused['tflops_per_device']:.3g} TFLOP/s {mfu(fused)} {fused['peak_memory_gib']:.1f} GiB")


def step_framework(check: Check, result: StepResult) -> None:
    """benchmarks.framework_step's sweep at configs/1-5B.yml's own depth (toy size with --cpu-plumbing), fused, each
    variant in a process of its own while the budget lasts, at micro-batch 8 where the memory model fits it on the
    card (else the largest it fits). The budget is the lease's: the CPU plumbing runs every variant however slow
    the machine, since it is there to prove each one's code runs, and compiles with aot_eager (dynamo's tracing
    and the compiled autograd graph without inductor's C++ build, 57 of its 72 CPU-seconds; tests/
    test_compiled_layers.py compiles with inductor)."""
    budget = max(FRAMEWORK_VARIANT_S, check.seconds_left() - FRAMEWORK_VARIANT_S)
    ran = run_benchmark(check, result, "benchmarks.framework_step",
                        ["--size", "toy" if check.cpu else "full", "--pattention-impl", "fused",
                         "--variants", *FRAMEWORK_VARIANTS, "--warmup", "2", "--steps", "4", "--profile-steps", "1",
                         *(["--compile-backend", "aot_eager"] if check.cpu else ["--budget", f"{budget:.0f}"])],
                        600 if check.cpu else budget + 120)
    if ran is None:
        return
    data, output = ran
    data["table"] = tail(output, 70)
    variants = data["variants"]
    result.details = data
    if "framework" not in variants:
        result.status, result.summary = "failed", "deepy.py's step was not measured"
        return
    framework = variants["framework"]
    peer = variants.get("plain+masters")
    data["framework_over_plain_masters"] = None if peer is None else framework["ratio_to_plain+masters"]
    retries = "" if framework["allocator_retries"] is None else f", {framework['allocator_retries']} allocator retries"
    versus = "" if peer is None else (f" = {data['framework_over_plain_masters']:.3f} x plain+masters' "
                                      f"{peer['tokens_per_sec']:,.0f}")
    decided = "; ".join(f"{row['lever']}: {row['winner']} ({row['on_over_off']:.3f})" for row in data["decisions"])
    result.summary = (f"micro-batch {data['micro_batch']}: deepy.py's step {framework['tokens_per_sec']:,.0f} tok/s "
                      f"MFU {framework['mfu']:.1%}{retries}{versus}; levers (on/off) {decided or 'none measured'}"
                      + (f"; not measured: {' '.join(data['not_measured'])}" if data["not_measured"] else ""))


def step_max_batch(check: Check, result: StepResult) -> None:
    ran = run_benchmark(check, result, "benchmarks.max_micro_batch", [], 180)
    if ran is None:
        return
    data, output = ran
    data["table"] = tail(output, 8)
    result.details = data
    fused, flash = data["rows"]
    result.summary = (f"fused {fused['largest']} (predicted {fused['predicted']['reserve 0']}), flash "
                      f"{flash['largest']} (predicted {flash['predicted']['reserve 0']}): ratio {data['ratio']:.2f}")


ONE_DEVICE_SECTIONS = ("environment", "golden", "throughput")  # cluster_check.py's sections one device can run


def step_cluster_check(check: Check, result: StepResult) -> None:
    """cluster_check.py's one-device sections (issue 48) as a user launches them, through deepy.py on one
    process: configs/1-5B.yml at the training step's reduced depth (a toy model with --cpu-plumbing) on the check's
    data. The versions and free memory, the repository's golden curve (made on a CPU) reproduced on the device,
    and tokens/s, MFU and peak memory against the memory model at the micro-batch it gives; its report's table."""
    from tests.distributed import free_port

    data, tokenizer = write_training_data(check.work / "data")
    log_dir = check.work / "logs" / "cluster_check"
    done = check.run([sys.executable, "deepy.py", "cluster_check.py", "configs/1-5B.yml",
                      str(training_overlay(check, data, tokenizer, 20)),
                      f"cluster_check_sections=[{', '.join(ONE_DEVICE_SECTIONS)}]", f"log_dir={log_dir}",
                      f"master_port={free_port()}"], timeout=300)
    report = log_dir / "cluster_check.md"
    text = report.read_text() if report.exists() else ""
    sections = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in text.splitlines()
                if row.startswith("| ") and row.split("|")[1].strip() in ONE_DEVICE_SECTIONS}
    result.details = {"sections": sections, "report": text, "output": tail(done.stdout + "\n" + done.stderr, 30),
                      "table": text.split("\n## ")[0] if text else None}
    result.summary = ", ".join(f"{name} {status}" for name, status in sections.items()) or (
        f"deepy.py exited {done.returncode}: no report")
    if done.returncode != 0 or sorted(sections) != sorted(ONE_DEVICE_SECTIONS):
        result.status = "failed"


# In order of what the open issues need measured first, so a run cut short still brings those back.
STEPS: dict[str, Callable[[Check, StepResult], None]] = {
    "kit": step_kit, "environment": step_environment, "kernels": step_kernels, "training": step_training,
    "gpu-tests": step_gpu_tests, "max-batch": step_max_batch, "cluster-check": step_cluster_check,
    "framework": step_framework,  # last: its variants take the time the others leave (WALL_BUDGET_S)
}


# --- report --------------------------------------------------------------------------------------------------

def target_figures(results: dict[str, StepResult], wall: float) -> dict[str, float | None]:
    details = lambda name: results[name].details if name in results else {}  # noqa: E731
    kernels, max_batch, framework = details("kernels"), details("max-batch"), details("framework")
    runs = details("training").get("runs", {})
    flash_over_fused = (runs["flash"]["tokens_per_sec"] / runs["fused"]["tokens_per_sec"]
                        if {"flash", "fused"} <= set(runs) else None)
    deepy_step = framework.get("variants", {}).get("framework", {})
    return {"framework / plain+masters tokens/s": framework.get("framework_over_plain_masters"),
            "training MFU (configs/1-5B.yml, full depth)": deepy_step.get("mfu"),
            "flash / six GEMMs at 1-5B shapes": kernels.get("flash_over_gemms_1_5B"),
            "flash / fused training tokens/s (4 layers)": flash_over_fused,
            "flash / fused peak memory at n >= 4d": kernels.get("peak_flash_over_fused_n_ge_4d"),
            "largest micro-batch flash / fused": max_batch.get("ratio"),
            "script wall time (s)": wall}


def verdict(figure: float | None, rule: tuple[str, float]) -> str:
    if figure is None:
        return "not measured"
    op, bound = rule
    return "met" if (figure <= bound if op == "<=" else figure >= bound) else "missed"


def write_report(results: list[StepResult], wall: float, out: Path, cpu: bool) -> dict:
    by_name = {r.name: r for r in results}
    figures = target_figures(by_name, wall)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "mode": "cpu-plumbing" if cpu else "gpu", "wall_seconds": wall,
              "environment": by_name["environment"].details if "environment" in by_name else {},
              "steps": [dataclasses.asdict(r) for r in results],
              "targets": {name: {"figure": figures[name], "rule": f"{op} {bound:g}",
                                 "verdict": verdict(figures[name], (op, bound))}
                          for name, (op, bound) in TARGETS.items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    environment = by_name["environment"].summary if "environment" in by_name else ""
    lines = [f"# GPU check, {report['date']} ({report['mode']})", "", environment, "",
             "| step | status | seconds | result |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.summary.replace('|', '/')} |" for r in results]
    lines += ["", "| target | rule | figure | verdict |", "|---|---|---|---|"]
    lines += [f"| {name} | {t['rule']} | {'-' if t['figure'] is None else format(t['figure'], '.3g')} | "
              f"{t['verdict']} |" for name, t in report["targets"].items()]
    for r in results:
        for table in (r.details.get("table") or r.details.get("output"), r.details.get("profile")):
            if table:
                lines += ["", f"## {r.name}", "", "```", table, "```"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return report


def print_table(results: list[StepResult], report: dict) -> None:
    print(f"\n{'step':<12} {'status':<12} {'s':>5}  result")
    for r in results:
        print(f"{r.name:<12} {r.status:<12} {r.seconds:>5.0f}  {r.summary}")
    for name, target in report["targets"].items():
        figure = "-" if target["figure"] is None else format(target["figure"], ".3g")
        print(f"target: {name} {target['rule']}: {figure} ({target['verdict']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", default=None, help="folder of the GPU kit's wheels (make gpu-kit: .gpu-kit)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="where the report goes")
    parser.add_argument("--skip", nargs="*", default=[], choices=list(STEPS), help="steps left out")
    parser.add_argument("--cpu-plumbing", action="store_true",
                        help="run the steps at toy sizes on a CPU (tests/test_gpu_check.py)")
    parser.add_argument("--environment-json", help=argparse.SUPPRESS)  # the environment step's own process
    options = parser.parse_args()
    if options.environment_json:
        Path(options.environment_json).write_text(json.dumps(environment_details(options.cpu_plumbing)))
        return
    if not options.cpu_plumbing:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks.gpu_check: needs a CUDA device (torch.cuda.is_available() is False); nothing "
                  "measured (--cpu-plumbing runs the steps at toy sizes on a CPU)", file=sys.stderr)
            sys.exit(UNAVAILABLE_EXIT)
    check = Check(options)
    start = time.perf_counter()
    try:
        for name, step in STEPS.items():
            result = StepResult(name)
            step_start = time.perf_counter()
            if name in options.skip:
                result.status, result.summary = "skipped", "--skip"
            else:
                try:
                    step(check, result)
                except Exception as error:  # one step's failure is reported; the others still run
                    result.status, result.summary = "failed", f"{type(error).__name__}: {error}"
            result.seconds = time.perf_counter() - step_start
            check.results.append(result)
            print(f"[gpu_check] {name}: {result.status} ({result.seconds:.0f} s) {result.summary}", flush=True)
            # after every step, so that a run stopped at the machine's time limit still brings its figures back
            write_report(check.results, time.perf_counter() - start, Path(options.out), options.cpu_plumbing)
    finally:
        shutil.rmtree(check.work, ignore_errors=True)
    report = write_report(check.results, time.perf_counter() - start, Path(options.out), options.cpu_plumbing)
    print_table(check.results, report)
    sys.exit(1 if any(r.status == "failed" for r in check.results) else 0)


if __name__ == "__main__":
    main()
