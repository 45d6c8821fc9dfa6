"""The framework's training step against the same model in a plain PyTorch loop, and where its extra time goes.

    python -m benchmarks.framework_step [--size cpu|toy|full] [--layers N] [--precision fp32|bf16]
        [--variants ...] [--warmup 2] [--steps 5] [--profile-steps 2] [--rounds 1] [--budget S] [--json FILE]
        [--compile-backend inductor]

One model, configs/1-5B.yml's (at `--size full`; `cpu` and `toy` keep its keys but shrink width, depth,
sequence and vocabulary to fit a CPU; `--layers` sets the depth), trained on one device in these ways, each on
the same batches from the same loader (the run's memory-mapped corpus and sampler) under the run's learning-rate
schedule:

    plain          TokenFormerModel in the run's dtype: forward, fp32 logits into F.cross_entropy, backward, torch's
                   fused AdamW with the config's betas, eps and weight-decay groups
    plain+masters  the same with fp32 master weights beside the model's, as mixed precision keeps them (and
                   DeepSpeed's ZeRO keeps them in fp32 too): gradients as fp32, clipped by their global norm,
                   AdamW on the masters, the masters copied into the model: the framework's recipe, its fair peer
    framework      the Trainer exactly as `deepy.py train.py configs/1-5B.yml` builds it: DeepSpeed's engine with
                   the config's ZeRO stage 1 and pipe_parallel_size 1, its data path, learning-rate schedule,
                   gradient clipping, non-finite check, exit conditions and a log line every log_interval (the
                   config's 1), its step as deepy.py takes it (the lean step on one process, eager layers)
    framework-deepspeed      ... with lean_step false: DeepSpeed's ZeRO-1 step and one-stage pipeline engine
    framework-deepspeed-pp0  ... and pipe_parallel_size 0: DeepSpeed's plain engine (GPT-NeoX's pp 0)
    framework+compile        ... with each layer compiled (compile: {enable: true}; `--compile-backend`
                   another of torch.compile's backends, e.g. aot_eager: the same tracing without inductor's code
                   generation, which on a CPU builds C++ for about a minute)
    framework+recompute      ... with the config's own activation checkpointing (its HFU counts the recomputed
                   forward; only when asked for)
    gpt-neox       transformers' GPTNeoXForCausalLM of the same parameter count (MLP width chosen to match) in the
                   plain loop

and on two data-parallel ranks (two processes, gloo on a CPU, one intra-op thread each on a CPU; tokens/s counts
each rank's tokens once):

    ddp            the plain loop a PyTorch user writes: torch's DistributedDataParallel (its bucketed all-reduce,
                   overlapped with backward), clip_grad_norm_ (foreach), torch's fused AdamW
    framework-dp2            deepy.py's step at DP 2 (the lean step: gradient_buckets.py's bucketed all-reduce,
                   ZeRO-1's update on the rank's partition, one all-gather); beside its breakdown, the all-reduce
                   of its whole gradient buffer timed alone ("the reduction's own time"), against which the
                   "gradient copies and reductions" phase is the wait left after backward
    framework-deepspeed-dp2  ... with lean_step false: DeepSpeed's ZeRO-1 step

Each variant runs in a process of its own (the whole device to itself, the allocator settings a rank of
deepy.py's gets); the variants follow each other in the order given, `--rounds` times, and each reports its
median round; `--budget` starts no variant after that many seconds (the GPU check's time limit). A run is
`--warmup` steps, then `--steps` timed together, then `--profile-steps` under torch.profiler; every step's loss is
kept on the device and read at the end (the loops wait for nothing). The corpus and the tokenizer are made here
(benchmarks/synthetic_data.py). bf16 on a GPU, fp32 on a CPU unless `--precision` says otherwise. TFLOP/s count
megatron/model/flops.py's model FLOPs (no recomputation; the same count for every variant); MFU is over the
device's dense bf16 peak (megatron/training/utilization.py) on a GPU and over the fastest fp32 GEMM measured here
on a CPU. The breakdown (benchmarks/step_breakdown.py) splits each variant's profiled steps by phase; the
decision table (benchmarks/framework_tables.py) sets each lever's variants side by side. The last line is
deepy.py's step's tokens/s over plain+masters' (and plain's beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.framework_tables import median_round, print_tables
from megatron.model.args import PATTENTION_IMPLS

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "1-5B.yml"
# deepy.py's step under overrides of configs/1-5B.yml (see the module docstring); {compile_backend} is the option's
FRAMEWORK_OVERRIDES = {
    "framework": [],
    "framework-deepspeed": ["lean_step=false"],
    "framework-deepspeed-pp0": ["lean_step=false", "pipe_parallel_size=0"],
    "framework+compile": ["compile={{enable: true, backend: {compile_backend}}}"],
    "framework+recompute": ["checkpoint_activations=true"],
    "framework-dp2": [],
    "framework-deepspeed-dp2": ["lean_step=false"],
}
DATA_PARALLEL = {"ddp": 2, "framework-dp2": 2, "framework-deepspeed-dp2": 2}  # variant -> ranks (processes)
VARIANTS = ("plain", "plain+masters", *FRAMEWORK_OVERRIDES, "gpt-neox", "ddp")
DEFAULT_VARIANTS = ("plain", "plain+masters", "framework", "framework-deepspeed", "gpt-neox")
# Shapes that fit a CPU, laid over configs/1-5B.yml (the 150M config's ratios: qkv = proj = d, ffn = 4d).
SIZES = {
    "full": {"vocab": 50277, "micro_batch": 8, "overrides": []},
    "cpu": {"vocab": 8192, "micro_batch": 2, "overrides": [
        "num_layers=4", "hidden_size=512", "num_attention_heads=8", "qkv_slot_num=512", "proj_slot_num=512",
        "ffn_slot_num=2048", "seq_length=512", "max_position_embeddings=512"]},
    "toy": {"vocab": 512, "micro_batch": 2, "overrides": [
        "num_layers=2", "hidden_size=64", "num_attention_heads=4", "qkv_slot_num=64", "proj_slot_num=64",
        "ffn_slot_num=256", "seq_length=64", "max_position_embeddings=64"]},
}


@dataclass
class Measured:
    """One variant's run, as its process reports it; the allocator's figures on a GPU only."""

    variant: str
    parameters: int
    tokens_per_step: int
    step_seconds: float
    peak_memory_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    allocator_retries: int | None = None  # cudaMalloc failures that freed the cache and retried, in timed steps
    breakdown: dict = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)  # every step's, warm-up, timed and profiled
    reduction_seconds: float | None = None  # the lean step's all-reduce of its gradient buffer alone, at DP > 1


# --- the run's config and model, shared by every variant --------------------------------------------------------

def run_overrides(options, variant: str = "framework") -> list[str]:
    """key=value overrides of configs/1-5B.yml for one process: the size, precision, the made-up data, one step =
    one micro-batch, no activation checkpointing, no evaluation or saving, then the framework variant's own."""
    overrides = list(SIZES[options.size]["overrides"])
    for key, value in (("num_layers", options.layers), ("pattention_impl", options.pattention_impl)):
        if value is not None:
            overrides.append(f"{key}={value}")
    micro_batch, iterations = options.micro_batch, options.warmup + options.steps + options.profile_steps
    ranks = DATA_PARALLEL.get(variant, 1)
    flag = lambda on: "true" if on else "false"  # noqa: E731
    return overrides + list(options.set or []) + [
        "fp16={enabled: false}", f"bf16={{enabled: {flag(options.precision == 'bf16')}}}", f"num_gpus={ranks}",
        f"train_micro_batch_size_per_gpu={micro_batch}", f"train_batch_size={micro_batch * ranks}",
        "gradient_accumulation_steps=1", "checkpoint_activations=false", "pipe_parallel_size=1",
        f"data_path={options.data}", f"vocab_file={options.tokenizer}",
        "tokenizer_type=HFTokenizer", "split=990,10,0", f"train_iters={iterations}", f"lr_decay_iters={iterations}",
        "eval_interval=100000", "eval_iters=1", "extra_save_iters=null", "keep_last_n_checkpoints=null",
        f"log_dir={Path(options.work) / 'logs'}", *variant_overrides(options, variant)]


def variant_overrides(options, variant: str) -> list[str]:
    """The framework variant's own overrides of the run's config."""
    return [override.format(compile_backend=options.compile_backend)
            for override in FRAMEWORK_OVERRIDES.get(variant, [])]


def device_and_dtype(precision: str):
    import torch
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    return device, {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def synchronize() -> None:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def allocator_figures() -> dict[str, int]:
    """The CUDA caching allocator's peaks and retries since the last reset (nothing on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"peak_memory_bytes": stats["allocated_bytes.all.peak"],
            "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
            "allocator_retries": stats["num_alloc_retries"]}


def profile_steps(run: Callable[[int], None], steps: int) -> dict:
    """The phase breakdown of `steps` steps of `run` under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_breakdown import as_json, breakdown

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run(steps)
        synchronize()
    return as_json(breakdown(prof.events(), steps))


def measure(variant: str, build: Callable[[], tuple[Callable[[int], None], Callable[[], list[float]], int, int,
                                                    Callable[[], float | None]]], options) -> Measured:
    """Warm-up, timed and profiled steps of the step function `build` returns (with a function reading back
    the losses of the steps run, the parameter count, the tokens a step trains and a function timing the step's
    gradient reduction alone)."""
    import torch

    run, losses, parameters, tokens, reduction = build()
    run(options.warmup)
    synchronize()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        retries_before = torch.cuda.memory_stats()["num_alloc_retries"]
    start = time.perf_counter()
    run(options.steps)
    synchronize()
    seconds = (time.perf_counter() - start) / options.steps
    memory = allocator_figures()
    if memory:
        memory["allocator_retries"] -= retries_before
    phases = profile_steps(run, options.profile_steps) if options.profile_steps else {}
    return Measured(variant, parameters, tokens, seconds, **memory, breakdown=phases, losses=losses(),
                    reduction_seconds=reduction())


# --- the variants -----------------------------------------------------------------------------------------------

def plain_loop(model, cfg, device, masters: bool, batches,
               clip: bool = False) -> tuple[Callable[[int], None], Callable[[], list]]:
    """Steps of the plain loop on `batches` (the run's loader) under the run's learning-rate schedule, and a function
    reading back their losses; `masters`: with fp32 master weights beside the model's (a copy even in fp32, as
    DeepSpeed's ZeRO keeps one) and the config's gradient clipping; `clip`: the clipping without the masters."""
    import torch
    import torch.nn.functional as F

    from megatron.training.learning_rates import LRSchedule
    from megatron.training.optimizer import parameter_groups
    from megatron.training.phases import BACKWARD, DATA, FORWARD, LOSS, OPTIMIZER, phase

    params = [p for p in model.parameters() if p.requires_grad]
    groups = parameter_groups(model, cfg.weight_decay)
    if masters:
        master_of = {p: p.detach().to(torch.float32, copy=True).requires_grad_() for p in params}
        groups = [{**g, "params": [master_of[p] for p in g["params"]]} for g in groups]
        master_list = [master_of[p] for p in params]
    settings = cfg.optimizer.get("params", {})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(settings.get("betas", (0.9, 0.999))),
                                  eps=settings.get("eps", 1e-8), fused=True)
    schedule, losses = LRSchedule.from_config(cfg), []

    def step() -> None:
        schedule.apply(optimizer, len(losses))
        with phase(DATA):
            batch = next(batches).to(device)
        with phase(FORWARD):
            logits = model(batch[:, :-1])
        with phase(LOSS):
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        with phase(BACKWARD):
            loss.backward()
        with phase(OPTIMIZER):
            if masters:
                for master, param in zip(master_list, params):
                    master.grad = param.grad.float()
                grads = [m.grad for m in master_list]
                norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
                torch._foreach_mul_(grads, (cfg.gradient_clipping / (norm + 1e-6)).clamp(max=1.0))
                optimizer.step()
                with torch.no_grad():
                    torch._foreach_copy_(params, master_list)
                optimizer.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
            else:
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, cfg.gradient_clipping, foreach=True)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    def run(steps: int) -> None:
        for _ in range(steps):
            step()

    return run, lambda: torch.stack(losses).tolist()


def gpt_neox_model(args):
    """transformers' GPTNeoXForCausalLM with TokenFormer `args`' width, depth, heads, vocabulary and parameter count
    (the MLP width that matches its Pattentions' parameters), returning logits."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from megatron.model.spec import layer_token_count

    d = args.hidden_size
    pattention_parameters = 2 * d * layer_token_count(vars(args))
    config = GPTNeoXConfig(
        vocab_size=args.padded_vocab_size, hidden_size=d, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads, intermediate_size=round((pattention_parameters - 4 * d * d)
                                                                              / (2 * d)),
        max_position_embeddings=args.seq_length, rotary_pct=args.rotary_pct, use_parallel_residual=False,
        tie_word_embeddings=True, attn_implementation="sdpa")

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPTNeoXForCausalLM(config)

        def forward(self, tokens):
            return self.model(input_ids=tokens).logits

    return Logits()


def run_config(options, variant: str = "framework"):
    from megatron.config import load_config

    return load_config([CONFIG], run_overrides(options, variant), world_size=DATA_PARALLEL.get(variant, 1))


def join_ranks(options) -> None:
    """This process as rank `options.rank` of `options.ranks` (one for most variants). The ranks of a DP variant
    share one device where there is one (on a GPU: the GPU check's one device) and talk over gloo, which takes
    CUDA tensors where NCCL refuses two ranks on one device."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    local_rank = options.rank % max(1, torch.cuda.device_count()) if torch.cuda.is_available() else options.rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(options.port), RANK=str(options.rank),
                      WORLD_SIZE=str(options.ranks), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(options.ranks))
    backend = "gloo" if options.ranks > 1 else get_accelerator().communication_backend_name()
    dist.init_process_group(backend, rank=options.rank, world_size=options.ranks)


def build_plain(options, masters: bool = False, neox: bool = False, ddp: bool = False):
    import torch

    from megatron.model import TokenFormerModel
    from megatron.training.data import batch_iterator, build_datasets
    from megatron.training.pretrain import run_model_args

    cfg = run_config(options, "ddp" if ddp else "plain")
    args = run_model_args(cfg)
    device, dtype = device_and_dtype(options.precision)
    torch.manual_seed(0)
    model = (gpt_neox_model(args) if neox else TokenFormerModel(args)).to(device=device, dtype=dtype)
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    if ddp:
        join_ranks(options)
        model = torch.nn.parallel.DistributedDataParallel(model)
    batches = batch_iterator(build_datasets(cfg).train, 0, cfg.train_micro_batch_size_per_gpu, options.rank,
                             options.ranks)
    run, losses = plain_loop(model, cfg, device, masters, batches, clip=ddp)
    tokens = cfg.train_micro_batch_size_per_gpu * cfg.seq_length * options.ranks
    return run, losses, parameters, tokens, lambda: None


def build_framework(options, variant: str):
    from megatron.training.pretrain import Trainer

    join_ranks(options)
    cfg = run_config(options, variant)
    trainer = Trainer(cfg)

    def run(steps: int) -> None:
        trainer.train(until=trainer.state.iteration + steps)

    def losses() -> list[float]:
        trainer.metrics.close()
        records = map(json.loads, (Path(cfg.log_dir) / "metrics.jsonl").read_text().splitlines())
        return [r["lm_loss"] for r in records if r["split"] == "train"]

    parameters = sum(p.numel() for p in trainer.engine.module.parameters())
    return run, losses, parameters, cfg.train_batch_size * cfg.seq_length, lambda: reduction_seconds(trainer)


BUILDERS = {
    "plain": lambda o: build_plain(o),
    "plain+masters": lambda o: build_plain(o, masters=True),
    **{name: (lambda o, name=name: build_framework(o, name)) for name in FRAMEWORK_OVERRIDES},
    "gpt-neox": lambda o: build_plain(o, neox=True),
    "ddp": lambda o: build_plain(o, ddp=True),
}


def reduction_seconds(trainer, repeats: int = 5) -> float | None:
    """The lean step's all-reduce of its whole gradient buffer over the data-parallel ranks, alone (a copy of
    the buffer, so the run's gradients stay as they are); None where `trainer` takes no lean step at DP > 1."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.training.lean_step import LeanStep

    if not isinstance(trainer.train_step, LeanStep) or mpu.get_data_parallel_world_size() == 1:
        return None
    buffer = trainer.train_step.update.buckets.flat.clone()
    dist.all_reduce(buffer, group=mpu.get_data_parallel_group())
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer, group=mpu.get_data_parallel_group())
    synchronize()
    return (time.perf_counter() - start) / repeats


# --- the parent: runs the variants, prints the tables -----------------------------------------------------------

def child_environment() -> dict[str, str]:
    """This process's environment with the device allocator's settings a rank of deepy.py's gets
    (megatron/runtime/entry.py), for every variant alike."""
    import torch

    from megatron.runtime.entry import allocator_settings

    return {**os.environ, **allocator_settings("cuda" if torch.cuda.is_available() else "cpu", os.environ)}


def child_run(options, variant: str, work: Path, round_index: int = 0) -> dict:
    """What `variant` measured in round `round_index` (or, for "info", the run's facts), in a process of its own:
    the device stays untouched in this one."""
    from tests.distributed import free_port

    out = work / f"{variant}-{round_index}.json"
    ranks, port = DATA_PARALLEL.get(variant, 1), free_port()
    command = [sys.executable, "-m", "benchmarks.framework_step", "--child", variant, "--json", str(out),
               "--work", str(work / f"{variant}-{round_index}"), "--port", str(port), "--ranks", str(ranks)]
    for name in ("size", "layers", "pattention_impl", "micro_batch", "precision", "warmup", "steps", "profile_steps",
                 "compile_backend", "data", "tokenizer"):
        if getattr(options, name) is not None:
            command += [f"--{name.replace('_', '-')}", str(getattr(options, name))]
    if options.set:
        command += ["--set", *options.set]
    environment = child_environment()
    if ranks > 1 and not torch_cuda_available():  # the measurement: one intra-op thread a rank
        environment.update(OMP_NUM_THREADS="1")
    processes = [subprocess.Popen([*command, "--rank", str(rank)], cwd=REPO, env=environment, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(ranks)]
    outputs = [process.communicate() for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs):
        if process.returncode != 0:
            raise RuntimeError(f"{variant} failed (exit {process.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return json.loads(out.read_text())


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_facts(options) -> dict:
    """The "info" child's answer: FLOPs per token, the device's peak and the micro-batch to run."""
    micro_batch, why = choose_micro_batch(options)
    options.micro_batch = micro_batch
    flops, text = peak_flops(options)
    return {"flops": flops_per_token_counts(options), "peak": [flops, text], "micro_batch": micro_batch, "why": why}


def flops_per_token_counts(options) -> tuple[int, int]:
    """(model FLOPs per token, with the recomputed forward too), megatron/model/flops.py."""
    from megatron.model import flops_per_token
    from megatron.training.pretrain import run_model_args

    args = run_model_args(run_config(options))
    return flops_per_token(args, include_recompute=False), flops_per_token(args, include_recompute=True)


def choose_micro_batch(options) -> tuple[int, str]:
    """`--micro-batch`, else the size's (configs/1-5B.yml's 8 at full size), or on a GPU the largest the memory
    model fits on this card without recomputation when that is fewer; and why."""
    import torch

    if options.micro_batch is not None:
        return options.micro_batch, f"micro-batch {options.micro_batch}"
    wanted = SIZES[options.size]["micro_batch"]
    if not torch.cuda.is_available():
        return wanted, f"micro-batch {wanted}"
    from megatron.model.memory import max_micro_batch
    from megatron.training.pretrain import run_model_args

    options.micro_batch = wanted
    args = run_model_args(run_config(options))
    fits = max_micro_batch(args, args.pattention_impl, False, torch.cuda.get_device_properties(0).total_memory,
                           0.1, 1, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[options.precision])
    if fits >= wanted:
        return wanted, f"micro-batch {wanted} (the memory model fits up to {fits} on this card)"
    return max(fits, 1), (f"micro-batch {max(fits, 1)}: the memory model fits no more on this card without "
                          f"recomputation (configs/1-5B.yml has {wanted})")


def peak_flops(options) -> tuple[float, str]:
    """(FLOP/s the MFU column divides by, what it is)."""
    import torch

    from megatron.training.utilization import table_peak_tflops

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        tflops = table_peak_tflops(name)
        if tflops is not None:
            return tflops * 1e12, f"{name}'s dense bf16 peak, {tflops:g} TFLOP/s"
    from benchmarks.train_throughput import gemm_peak_flops

    flops = gemm_peak_flops(3, "wall")
    return flops, f"the fastest fp32 2048³ GEMM here, {flops / 1e9:.1f} GFLOP/s"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="full on a GPU, cpu elsewhere (toy: the test's)")
    parser.add_argument("--layers", type=int, default=None, help="depth (default: the size's)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--pattention-impl", choices=("auto", *PATTENTION_IMPLS), default=None,
                        help="default: the config's (auto)")
    parser.add_argument("--set", nargs="+", metavar="KEY=VALUE",
                        help="config overrides for every variant (e.g. a ZeRO setting, to measure what it costs)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="default: the size's (full: 8, or on a GPU the most the memory model fits)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                        help=f"default: {' '.join(DEFAULT_VARIANTS)}; run in this order")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled steps (0: no breakdown)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant; the median counts")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend in framework+compile (default inductor, as the config's)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which no further variant starts (those left are not measured)")
    parser.add_argument("--json", default=None, help="write the figures here")
    # Set by the parent for each variant's process.
    parser.add_argument("--child", choices=[*VARIANTS, "info"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.set and options.child is None:  # one line here, not a child's traceback after the data is built
        from megatron.config import ConfigError
        from megatron.config.loader import parse_override
        from megatron.config.validate import check_keys

        try:  # each key and value alone: how they combine with a variant's own settings is the child's to check
            check_keys(dict(map(parse_override, options.set)), {})
        except ConfigError as error:
            parser.exit(2, f"{parser.prog}: error: --set: {error}\n")
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse(argv)
    if options.child == "info":
        Path(options.json).write_text(json.dumps(run_facts(options)))
        return
    if options.child:
        result = measure(options.child, lambda: BUILDERS[options.child](options), options)
        if options.rank == 0:
            Path(options.json).write_text(json.dumps(asdict(result)))
        return
    import torch

    from benchmarks.synthetic_data import write_training_data

    gpu = torch.cuda.is_available()
    options.size = options.size or ("full" if gpu else "cpu")
    options.precision = options.precision or ("bf16" if gpu else "fp32")
    variants = options.variants or list(DEFAULT_VARIANTS)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="framework_step_") as folder:
        work = Path(folder)
        data, tokenizer = write_training_data(work / "data", SIZES[options.size]["vocab"], documents=200)
        options.data, options.tokenizer = str(data), str(tokenizer)
        options.work = str(work)
        facts = child_run(options, "info", work)
        options.micro_batch = facts["micro_batch"]
        rounds: dict[str, list[Measured]] = {}
        for round_index in range(options.rounds):
            for variant in variants:
                if options.budget is not None and time.perf_counter() - start > options.budget:
                    break
                rounds.setdefault(variant, []).append(Measured(**child_run(options, variant, work, round_index)))
    results = {variant: median_round(measured) for variant, measured in rounds.items()}
    left_out = [v for v in variants if v not in results]
    flops, peak = tuple(facts["flops"]), tuple(facts["peak"])
    depth = "" if options.layers is None else f", {options.layers} layers"
    print(f"{'GPU' if gpu else 'CPU'}, {options.size} size{depth}, {options.precision}, {facts['why']}; "
          f"{options.warmup} warm-up + {options.steps} timed steps per variant, median of {options.rounds}"
          + (f"; not measured within the {options.budget:g} s budget: {' '.join(left_out)}" if left_out else ""))
    tables = print_tables(results, flops, peak, on_device=gpu)
    if options.json:
        Path(options.json).write_text(json.dumps({"size": options.size, "layers": options.layers,
                                                  "micro_batch": options.micro_batch, "precision": options.precision,
                                                  "peak": peak[1], "not_measured": left_out, **tables}, indent=1))


if __name__ == "__main__":
    main()
