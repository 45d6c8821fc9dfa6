"""Section 5, throughput: the config's own model, in its layout and precision, for STEPS steps.

The micro-batch is the largest the memory model (megatron/training/pattention_choice.py's per-rank estimate:
model states under the config's precision and ZeRO stage, activations of the rank's share of the model) fits
in a device with RESERVE of it kept free, up to MICRO_BATCH_TOKENS (beyond it a step only takes longer, not
faster per token); `pattention_impl: auto` takes fused if a micro-batch fits with it, as a training run would,
else flash. Accumulation is 1 without a pipeline and 2 x the stages with one (the config's
global batch would make 20 steps take hours). Reported: tokens/s and MFU (megatron/training/utilization.py),
each rank's median step time, and the peak memory against the memory model's prediction; a peak above the
prediction plus the reserve fails (the micro-batch the memory model gives would not be safe here), and so does
an MFU below `cluster_check_mfu_floor` (the slowest rank named) on a device with a known peak.

CPU processes run the config's architecture at the numerics section's small size (variants.small_model) for
CPU_STEPS steps with the micro-batch capped at CPU_MICRO_BATCH: the figures are that model's, and the report
says so. The peak is then the process's resident memory, which the memory model does not describe.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from deepspeed.accelerator import get_accelerator

from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.ranks import gather
from megatron.cluster_check.report import SectionResult
from megatron.cluster_check.training_runs import batches, engine_for, release
from megatron.cluster_check.variants import small_model, variant
from megatron.model import TokenFormerArgs, flops_per_token
from megatron.model.memory import GIB, NotModelled
from megatron.model.rank_memory import RunShape, training_bytes_per_rank
from megatron.tokenizer import build_tokenizer, pad_vocab_size
from megatron.training.pattention_choice import RESERVE, device_bytes_per_rank
from megatron.training.utilization import Utilization, peak_memory_bytes

NAME = "throughput"
STEPS, WARMUP = 20, 5
CPU_STEPS, CPU_WARMUP = 6, 2
CPU_MICRO_BATCH = 4
MICRO_BATCH_TOKENS = 65536  # at most, so that 20 steps of a 1-5B model take about a minute (docs/cluster.md)
RANKS_LISTED = 16  # ranks whose step times the report lists one by one


def largest_micro_batch(args: TokenFormerArgs, impl: str, shape: RunShape, device_type: str,
                        device_bytes: int) -> int:
    """The most sequences per micro-batch whose per-rank estimate fits (1 − RESERVE) of `device_bytes` (0: none),
    searched: the estimate grows with the micro-batch, not quite linearly (the loss's blocks)."""
    budget = (1 - RESERVE) * device_bytes

    def fits(micro: int) -> bool:
        return training_bytes_per_rank(args, impl, dataclasses.replace(shape, micro_batch=micro), device_type) <= budget

    low, high = 0, 1
    while fits(high) and high < 2**20:
        low, high = high, 2 * high
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _plan(context: CheckContext) -> dict:
    """The run: its config's changes, the micro-batch and implementation, the memory model's prediction."""
    cfg = context.cfg
    tensor, pipe = cfg.model_parallel_size, cfg.pipe_parallel_size
    model = small_model(cfg, tensor, pipe) if context.on_cpu else {}
    accumulation = 1 if pipe <= 1 else 2 * pipe
    sized = variant(cfg, **model, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=accumulation)
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)
    args = TokenFormerArgs.from_config(sized, padded_vocab_size=pad_vocab_size(
        tokenizer.vocab_size, cfg.make_vocab_size_divisible_by, tensor))
    device_type, device_bytes = get_accelerator().device_name(), device_bytes_per_rank(get_accelerator())
    shape = RunShape.from_config(sized)
    impls = ("fused", "flash") if cfg.pattention_impl == "auto" else (cfg.pattention_impl,)
    plan = {"model": model, "accumulation": accumulation, "device_bytes": device_bytes, "predicted": None}
    if args.model_type != "tokenformer":
        plan.update(impl=impls[0], micro=cfg.train_micro_batch_size_per_gpu,
                    why="the config's (the memory model covers TokenFormer only)")
        return plan
    try:
        for impl in impls:
            micro = largest_micro_batch(args, impl, shape, device_type, device_bytes)
            if micro:
                break
    except NotModelled as reason:
        plan.update(impl=impls[0], micro=cfg.train_micro_batch_size_per_gpu, why=f"the config's ({reason})")
        return plan
    why = f"the memory model's largest for {device_bytes / GIB:.1f} GiB per rank with {RESERVE:.0%} kept free"
    cap = CPU_MICRO_BATCH if context.on_cpu else max(1, MICRO_BATCH_TOKENS // args.seq_length)
    if micro > cap:
        where = "on CPU processes" if context.on_cpu else f"({MICRO_BATCH_TOKENS:,} tokens)"
        micro, why = cap, f"{why}, {micro}, capped at {cap} {where}"
    plan.update(impl=impl, micro=micro, why=why)
    if micro:
        plan["predicted"] = training_bytes_per_rank(args, impl, dataclasses.replace(shape, micro_batch=micro),
                                                    device_type)
    return plan


def _mfu_floor(result: SectionResult, context: CheckContext, record: dict, tokens_per_sec: float,
               slowest: int) -> str:
    """Fail an MFU below cluster_check_mfu_floor, naming the slowest rank (the step waits for it); the line the
    figures give about the floor."""
    floor = context.cfg.cluster_check_mfu_floor
    if not floor:
        return "no MFU floor (cluster_check_mfu_floor: 0)"
    if context.on_cpu:
        return f"MFU floor {floor:.0%} not applied: CPU processes are a report only"
    if record["mfu"] is None:
        return f"MFU floor {floor:.0%} not applied: no peak FLOP/s for this device (set peak_tflops)"
    if record["mfu"] < floor:
        expected = tokens_per_sec * floor / record["mfu"]
        result.fail(context.ranks.who(slowest), f"MFU {record['mfu']:.1%}, below the floor cluster_check_mfu_floor "
                    f"= {floor:.0%}: {tokens_per_sec:,.0f} tokens/s where the FLOP model gives {expected:,.0f} at the "
                    "floor (the slowest rank sets the step)",
                    "a throttled or faulty device or link, or other work on the node (nvidia-smi -q -d "
                    "PERFORMANCE,TEMPERATURE; the collectives section's stragglers); peak_tflops if the device's "
                    "peak is set wrong")
    return f"MFU floor {floor:.0%}"


def run(context: CheckContext) -> SectionResult:
    cfg, result = context.cfg, SectionResult(NAME)
    plan = _plan(context)
    if not plan["micro"]:
        result.fail(context.ranks.name(list(range(cfg.world_size))), f"the memory model fits no sequence of "
                    f"{cfg.seq_length} tokens in {plan['device_bytes'] / GIB:.1f} GiB per rank, with {RESERVE:.0%} "
                    "kept free", "split the model over more ranks (model_parallel_size, pipe_parallel_size), or set "
                    "checkpoint_activations: true")
        result.summary = "the config's model does not fit a device by the memory model: not run"
        return result
    steps, warmup = (CPU_STEPS, CPU_WARMUP) if context.on_cpu else (STEPS, WARMUP)
    run_cfg = variant(cfg, **plan["model"], pattention_impl=plan["impl"], train_micro_batch_size_per_gpu=plan["micro"],
                      gradient_accumulation_steps=plan["accumulation"], train_iters=steps,
                      hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout)
    accelerator = get_accelerator()
    engine, model_args, step = engine_for(run_cfg)
    data = batches(run_cfg, model_args.padded_vocab_size)
    accelerator.reset_peak_memory_stats()
    seconds, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss, _ = step(data)
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
    peak = peak_memory_bytes(accelerator)
    del step  # the lean step holds the engine and its gradient buffer
    release(engine)
    step_times = gather(statistics.median(seconds[warmup:]))
    peaks = gather(peak)
    step = max(step_times)
    tokens_per_sec = run_cfg.train_batch_size * run_cfg.seq_length / step
    hardware_flops = flops_per_token(model_args, include_recompute=run_cfg.checkpoint_activations)
    utilization = Utilization(accelerator, hardware_flops, flops_per_token(model_args, include_recompute=False),
                              cfg.world_size, cfg.peak_tflops)
    record = utilization.record(tokens_per_sec)
    if not all(map(math.isfinite, losses)):
        result.fail(context.ranks.name(list(range(cfg.world_size))), f"non-finite losses {losses}",
                    "the config's model does not train stably in this precision: check the numerics section and "
                    "the learning rate")
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    floor_line = _mfu_floor(result, context, record, tokens_per_sec, slowest)
    predicted, reserve = plan["predicted"], RESERVE * plan["device_bytes"]
    memory = "peak resident memory (CPU processes: not compared with the memory model)"
    if predicted is not None and not context.on_cpu:
        memory = f"peak {max(peaks) / GIB:.2f} GiB against {predicted / GIB:.2f} GiB predicted"
        for rank, rank_peak in enumerate(peaks):
            if rank_peak > predicted + reserve:
                result.fail(context.ranks.who(rank), f"peak memory {rank_peak / GIB:.2f} GiB, above the memory "
                            f"model's {predicted / GIB:.2f} GiB plus its {RESERVE:.0%} reserve",
                            "train with a smaller micro-batch than the memory model gives, and report the "
                            "difference (megatron/model/memory.py)")
    size = (f"CPU processes: the config's architecture at a small size ({run_cfg.num_layers} layers, width "
            f"{run_cfg.hidden_size}, sequence {run_cfg.seq_length}), {steps} steps: figures of that model, not "
            "of the config's" if context.on_cpu else
            f"the config's model ({run_cfg.num_layers} layers, width {run_cfg.hidden_size}, sequence "
            f"{run_cfg.seq_length}), {steps} steps")
    mfu = "n/a (no peak FLOP/s for this device: set peak_tflops)" if record["mfu"] is None else f"{record['mfu']:.1%}"
    median = statistics.median(step_times)
    result.figures = [
        f"Run: {size}; pattention_impl {plan['impl']}; micro-batch {plan['micro']} ({plan['why']}); "
        f"accumulation {plan['accumulation']}; {run_cfg.train_batch_size} sequences per step; {run_cfg.precision}.",
        "", f"- tokens/s: {tokens_per_sec:,.0f} (median step {step * 1e3:.1f} ms after {warmup} warm-up steps)",
        f"- per device: {record['tflops_per_device'] * 1e3:.3g} GFLOP/s, MFU {mfu}; {floor_line}",
        f"- memory: {memory}; largest {max(peaks) / GIB:.2f} GiB ({context.ranks.who(peaks.index(max(peaks)))})",
        f"- step time per rank: median {median * 1e3:.1f} ms, slowest {context.ranks.who(slowest)} "
        f"{step_times[slowest] * 1e3:.1f} ms"]
    if len(step_times) <= RANKS_LISTED:
        result.figures += ["", "| rank | host | median step (ms) | peak memory (GiB) |", "|---|---|---|---|"]
        result.figures += [f"| {r} | {context.ranks.hosts_by_rank[r]} | {t * 1e3:.1f} | {peaks[r] / GIB:.2f} |"
                           for r, t in enumerate(step_times)]
    result.summary = (f"{tokens_per_sec:,.0f} tokens/s, MFU {mfu}, micro-batch {plan['micro']} ({plan['impl']}); "
                      f"{memory}" + ("; CPU: a small model" if context.on_cpu else ""))
    return result
