"""The training step on one pipeline stage, at any data-parallel size, without DeepSpeed's per-step machinery.

There DeepSpeed's engine pays for work that cannot change the result: its ZeRO-1 optimizer copies every
gradient into a bucket and flattens the bucket again to reduce it, flattens the partition, takes each tensor's
norm of a float64 copy and reads the norm back to the host; its pipeline engine runs a one-stage schedule
with cloned inputs. `LeanStep` runs the same step on the same storage, owned by the same engine:

    per micro-batch  the engine's module forward, the loss, backward of loss / accumulation steps (autograd
                     sums the micro-batches' gradients in place in one flat buffer, in the model's dtype, as
                     DeepSpeed's ZeRO-1 sums them in .grad when no separate accumulation dtype is configured);
                     on the last one, each bucket's all-reduce starts as backward finishes it
                     (gradient_buckets.py: DeepSpeed's buckets, collective and division)
    at the boundary  the reductions waited for; the global norm of the rank's partition (gradient_clipping.py:
                     one multi-tensor norm in fp32, no float64 copy), its squares summed over the ranks;
                     DeepSpeed's clipping rule on the device; fused AdamW on the rank's flat fp32 masters and
                     moments (bf16 gradients widened to fp32 first, one copy), skipped on the device when the
                     norm is not finite, where DeepSpeed skips it after reading the norm; DeepSpeed's copy of
                     the masters into the model's flat weights and its all-gather of the partitions. In fp16 the
                     loss is scaled by DeepSpeed's loss scaler, the gradients unscaled in the clipping's
                     multiplication (its `unscale_and_clip_grads`), and the scaler told of an overflow (a norm
                     that is not finite) once the norm is read
    read back        the step's mean loss over the ranks and the norm, in one transfer: the step's only wait

Everything else stays DeepSpeed's: the model, the fp32 masters and Adam's moments live in its engine and
optimizer, which load and save checkpoints (global_steps, global_samples and skipped_steps advance here as its
own step advances them, so the files are those its step leaves, and a run switches steps at a resume). With ZeRO
stage 0 in fp32 the update is our torch optimizer's on the module's parameters. The loss, the weights and Adam's
state are those of DeepSpeed's step bit for bit wherever the clipping factor is 1 (tests/test_lean_step.py,
tests/test_lean_step_data_parallel.py: DP 1, 2 and 4, TP 2 x DP 2); where clipping scales the gradients, the fp32
norm differs from DeepSpeed's float64-accumulated one in its last bits, and so does the factor.

`lean_step_problem` decides, from the config, the process layout and the device type: the lean step where it is
this computation (`lean_step: true`, the default, on a device with torch's fused AdamW), DeepSpeed's step elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from megatron import mpu
from megatron.checkpoint.engine_optimizer import step_tensor
from megatron.training.gradient_clipping import clip_by_norm_, clips_in_optimizer, counted_in_norm, global_norm
from megatron.training.gradient_buckets import GradientBuckets, engine_buckets, zero_one_buckets
from megatron.training.optimizer import has_fused_adamw
from megatron.training.phases import BACKWARD, DATA, FORWARD, GRADIENT_REDUCTION, LOSS_READOUT, OPTIMIZER, phase
from megatron.training.step import lm_loss, train_step

_ZERO_KEYS_OF_DEEPSPEED_STEP = ("offload_optimizer", "offload_param", "parameter_alignment", "round_robin_gradients")


def lean_step_problem(cfg, device_type: str) -> str | None:
    """Why `cfg`'s run, on devices of `device_type` ("cuda", "cpu", "hpu", ...), takes DeepSpeed's step rather
    than the lean one; None when it takes the lean one (at any data-parallel size)."""
    zero = cfg.zero_optimization or {}
    stage = zero.get("stage", 0)
    if not cfg.lean_step:
        return "lean_step is false"
    if not has_fused_adamw(device_type):
        return f"torch has no fused AdamW on {device_type}, which the lean step needs to skip a step on the device"
    if cfg.pipe_parallel_size > 1:
        return f"pipe_parallel_size {cfg.pipe_parallel_size}: the stages run DeepSpeed's pipeline schedule"
    if stage not in (0, 1) or (stage == 0 and not clips_in_optimizer(cfg)):
        return f"ZeRO stage {stage} in {cfg.precision} keeps its gradients and masters in DeepSpeed's own form"
    set_keys = [key for key in _ZERO_KEYS_OF_DEEPSPEED_STEP if zero.get(key)]
    if set_keys:
        return f"zero_optimization.{set_keys[0]} is DeepSpeed's own"
    return None


def training_step_for(engine, cfg, deepspeed_step: str | None) -> Callable[[Iterator[torch.Tensor]], tuple]:
    """The step `engine` trains with: DeepSpeed's (step.py's train_step) where `deepspeed_step`, lean_step_problem's
    answer for the run, says why, else the lean one; `step(batches)` -> (mean loss, global gradient norm)."""
    return partial(train_step, engine) if deepspeed_step else LeanStep(engine, cfg)


class _ZeroOneUpdate:
    """DeepSpeed's ZeRO stage 1 optimizer's update on this rank's partition, on its own flat fp32 masters and Adam
    state: the averaged gradients (GradientBuckets, in the optimizer's order) read at the partition's place, widened
    to fp32 (one copy, bf16 only); the norm of the partition, its squares summed over the data-parallel ranks;
    torch's fused AdamW on the flat partition (its arithmetic is per element, so element for element DeepSpeed's
    update); then DeepSpeed's own `update_lp_params`: the masters into the rank's partition of the model's flat
    weights and one all-gather of the partitions. The padding DeepSpeed adds at a group's end has a gradient of 0
    and stays 0 under its update, so it is left out."""

    def __init__(self, optimizer: DeepSpeedZeroOptimizer, max_norm: float, device: torch.device) -> None:
        self.optimizer, self.max_norm, self.device = optimizer, max_norm, device
        self.group = optimizer.dp_process_group
        rank, ranks = dist.get_rank(self.group), dist.get_world_size(self.group)
        groups, self.pieces = [], []  # per group: (offset in the buffer, length) of this rank's partition
        self.counted = []  # (group, offset in its piece, length, row length) of each counted parameter's part
        buffer_offset, piece_offset = 0, 0
        for i, flat in enumerate(optimizer.bit16_groups_flat):
            params, size = optimizer.bit16_groups[i], optimizer.partition_size[i]
            offsets = [(p.data_ptr() - flat.data_ptr()) // p.element_size() for p in params]
            partitions = optimizer.parallel_partitioned_bit16_groups[i]
            if offsets != [sum(p.numel() for p in params[:k]) for k in range(len(params))] or any(
                    (part.data_ptr() - flat.data_ptr()) // part.element_size() != r * size
                    for r, part in enumerate(partitions)) or size * ranks != flat.numel():
                raise ValueError(f"ZeRO parameter group {i} is not laid out as contiguous partitions of its "
                                 "parameters in order")
            low = rank * size
            length = max(0, min(low + size, sum(p.numel() for p in params)) - low)
            for p, offset in zip(params, offsets, strict=True):
                start, end = max(offset, low), min(offset + p.numel(), low + length)
                if start < end and counted_in_norm(p):
                    row = p.shape[-1] if p.dim() > 1 and (start - offset) % p.shape[-1] == 0 and (
                        end - start) % p.shape[-1] == 0 else end - start
                    self.counted.append((i, start - low, end - start, row))
            self.pieces.append((buffer_offset + low, length))
            buffer_offset += offsets[-1] + params[-1].numel()
            piece_offset += length
            groups.append(params)
        self.params = [p for params in groups for p in params]
        dtype = self.params[0].dtype
        self.buckets = GradientBuckets(self.params, zero_one_buckets([p.numel() for p in self.params],
                                                                     int(optimizer.reduce_bucket_size)),
                                       self.group, divide_first=True)
        self.widened = None if dtype == torch.float32 else torch.empty(piece_offset, dtype=torch.float32,
                                                                        device=device)
        self.padding = [torch.zeros(size - length, device=device)
                        for size, (_, length) in zip(optimizer.partition_size, self.pieces, strict=True)]
        self.loss_scaled = dtype == torch.float16  # fp16: DeepSpeed's loss scaler scales the loss, unscaled here

    def step(self) -> torch.Tensor:
        """The update from the averaged gradients; returns the global norm (a device tensor)."""
        opt, flat = self.optimizer, self.buckets.flat
        grads = [flat[start:start + length] for start, length in self.pieces]
        if self.widened is not None:
            widened = list(self.widened.split([length for _, length in self.pieces]))
            torch._foreach_copy_(widened, grads)
            grads = widened
        norm = global_norm([grads[i][start:start + length].view(-1, row) for i, start, length, row in self.counted],
                           self.device, sharded_over=self.group)
        scale = opt.loss_scale if self.loss_scaled else 1.0
        clip_by_norm_(grads, norm, self.max_norm, scale)
        found_inf = (~torch.isfinite(norm)).float()
        for grad, padding, master, group in zip(grads, self.padding, opt.single_partition_of_fp32_groups,
                                                opt.optimizer.param_groups, strict=True):
            state, length = self._state(master, group), grad.numel()
            moments = [state["exp_avg"], state["exp_avg_sq"]]
            if padding.numel() == 0:
                _fused_adamw([master], [grad], *[[m] for m in moments], state["step"], group, found_inf)
            elif length:
                _fused_adamw([master[:length]], [grad], *[[m[:length]] for m in moments], state["step"], group,
                             found_inf)
            else:  # a partition of padding only: its count advances as DeepSpeed's does
                _fused_adamw([master], [padding], *[[m] for m in moments], state["step"], group, found_inf)
        opt._lazy_init_hp_params_optimizer_state()  # DeepSpeed links each parameter to its Adam state once
        opt.update_lp_params()
        self.buckets.zero()
        return norm / scale if self.loss_scaled else norm

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from: in fp16, times DeepSpeed's loss scale."""
        return self.optimizer.scale_if_loss(loss) if self.loss_scaled else loss

    def after(self, applied: bool) -> None:
        """Once the step's norm is read: fp16's dynamic loss scale updated by DeepSpeed's scaler."""
        if self.loss_scaled:
            self.optimizer._update_scale(not applied)

    def _state(self, master: torch.Tensor, group: dict) -> dict:
        """The Adam state of flat partition `master`, created as torch's fused AdamW creates it at its first step."""
        inner = self.optimizer.optimizer
        if master not in inner.state:
            inner.state[master] = {"step": step_tensor(0, group, master),
                                   "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                                   "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}
        return inner.state[master]


def _fused_adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], step: torch.Tensor, group: dict, found_inf: torch.Tensor) -> None:
    """What torch.optim.AdamW(fused=True).step() runs for one parameter group, for tensors sharing one step count:
    the count advanced once, the kernel (which skips everything when found_inf is 1), the count set back then."""
    beta1, beta2 = group["betas"]
    step.add_(1)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params), amsgrad=False,
                        lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                        eps=group["eps"], maximize=group["maximize"], grad_scale=None, found_inf=found_inf)
    step.sub_(found_inf)


class _TorchUpdate:
    """ZeRO stage 0 in fp32: the module's gradients averaged as DeepSpeed's engine averages them (GradientBuckets),
    then our torch optimizer steps the module's parameters on every rank."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, max_norm: float,
                 device: torch.device) -> None:
        self.optimizer, self.max_norm, self.device = optimizer, max_norm, device
        self.params = [p for p in module.parameters() if p.requires_grad and p.numel()]
        self.counted = [p for p in self.params if counted_in_norm(p)]
        self.buckets = GradientBuckets(self.params, engine_buckets([p.numel() for p in self.params],
                                                                   MEMORY_OPT_ALLREDUCE_SIZE),
                                       mpu.get_data_parallel_group(), divide_first=False)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after(self, applied: bool) -> None:
        pass

    def step(self) -> torch.Tensor:
        norm = global_norm([p.grad for p in self.counted], self.device)
        clip_by_norm_([p.grad for p in self.params], norm, self.max_norm)
        _skipping_unless_finite(self.optimizer, norm)
        self.buckets.zero()
        return norm


def _skipping_unless_finite(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
    """optimizer.step(), which torch's fused AdamW skips on the device (weights, moments and step count
    untouched) when `found_inf` is 1: no wait for the norm."""
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


class LeanStep:
    """`step(batches)` -> (mean loss of the global batch, global gradient norm): one optimizer step of
    `engine`, which setup_model_and_engine built for a run lean_step_problem accepts."""

    def __init__(self, engine, cfg) -> None:
        self.engine = engine
        self.module = engine.module
        self.device = engine.device
        self.accumulation = engine.gradient_accumulation_steps()
        self.data_parallel_size = mpu.get_data_parallel_world_size()
        optimizer = engine.optimizer
        if isinstance(optimizer, DeepSpeedZeroOptimizer):
            for hook in optimizer._grad_acc_hooks:  # its gradient bucketing, which this step replaces
                hook.remove()
            optimizer._grad_acc_hooks = []
            self.update = _ZeroOneUpdate(optimizer, cfg.gradient_clipping, engine.device)
        elif isinstance(optimizer, torch.optim.Optimizer) and clips_in_optimizer(cfg):
            self.update = _TorchUpdate(optimizer, self.module, cfg.gradient_clipping, engine.device)
        else:
            raise ValueError(f"LeanStep: DeepSpeed built a {type(optimizer).__name__}, whose update is its own")
        if not all(group.get("fused") for group in getattr(optimizer, "optimizer", optimizer).param_groups):
            raise ValueError("LeanStep: the optimizer is not torch's fused AdamW, which skips on the device")
        for name in ("module_forward_pre_hook", "module_forward_post_hook"):  # the engine's forward timers
            handle = getattr(engine, name, None)
            if handle is not None:
                handle.remove()
                setattr(engine, name, None)

    def __call__(self, batches: Iterator[torch.Tensor]) -> tuple[float, float]:
        if not self.module.training:
            self.module.train()
        total = torch.zeros((), device=self.device)
        buckets = self.update.buckets
        for micro_batch in range(self.accumulation):
            buckets.start_step(last_micro_batch=micro_batch == self.accumulation - 1)
            with phase(DATA):
                batch = next(batches).to(self.device)
            with phase(FORWARD):
                logits = self.module(batch[:, :-1])
            loss = lm_loss(logits, batch[:, 1:])
            with phase(BACKWARD):  # x / 1 is x: no division without accumulation
                self.update.scaled(loss / self.accumulation if self.accumulation > 1 else loss).backward()
            total += loss.detach()
        if self.data_parallel_size > 1:  # one rank: nothing to reduce, no phase
            with phase(GRADIENT_REDUCTION):
                buckets.wait()
        with phase(OPTIMIZER):
            norm = self.update.step()
        with phase(LOSS_READOUT):  # the mean over the data-parallel ranks, as step.py's data_parallel_mean takes it
            loss = total / self.accumulation
            if self.data_parallel_size > 1:
                dist.all_reduce(loss, group=mpu.get_data_parallel_group())
            loss_sum, norm_value = torch.stack([loss, norm]).tolist()
            loss_value = loss_sum / self.data_parallel_size
        applied = math.isfinite(norm_value)
        self.update.after(applied)
        self._advance(applied)
        return loss_value, norm_value if applied else math.inf

    def _advance(self, applied: bool) -> None:
        """The engine's counters and flags, as its own step leaves them (its checkpoints save them)."""
        engine = self.engine
        engine.optimizer.overflow = not applied
        engine._step_applied = applied
        engine.skipped_steps += not applied
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()
        engine.micro_steps += self.accumulation
