"""The training step on one data-parallel rank and one pipeline stage, without DeepSpeed's per-step machinery.

There DeepSpeed's engine pays for work that cannot change the result: its ZeRO-1 optimizer copies every
gradient into a bucket, divides it by a data-parallel size of 1, flattens the partition, takes each tensor's
norm of a float64 copy and reads the norm back to the host; its pipeline engine runs a one-stage schedule
with cloned inputs and gradient "reductions" over groups of one process. `LeanStep` runs the same step on
the same storage, owned by the same engine:

    per micro-batch  the engine's module forward, the loss, backward of loss / accumulation steps (autograd
                     sums the micro-batches' gradients in each parameter's .grad, in the model's dtype,
                     as DeepSpeed's ZeRO-1 does when no separate accumulation dtype is configured)
    at the boundary  ZeRO-1: the gradients into one fp32 buffer per parameter group laid out as its fp32
                     master partition (one multi-tensor copy); the global norm (gradient_clipping.py: one
                     multi-tensor norm in fp32, no float64 copy); DeepSpeed's clipping rule on the device;
                     AdamW (skipped on the device when the norm is not finite, where DeepSpeed skips it after
                     reading the norm); ZeRO-1: the masters copied into the model's flat weights
    read back        the step's mean loss and the norm, in one transfer: the step's only wait for the device

Everything else stays DeepSpeed's: the model, the fp32 masters and Adam's moments live in its engine and
optimizer, which load and save checkpoints (global_steps, global_samples and skipped_steps advance here as its
own step advances them, so the files are those its step leaves). With ZeRO stage 0 in fp32 the update is our
torch optimizer's on the module's parameters. The loss, the weights and Adam's state are those of DeepSpeed's
step bit for bit wherever the clipping factor is 1 (tests/test_lean_step.py); where clipping scales the
gradients, the fp32 norm differs from DeepSpeed's float64-accumulated one in its last bits, and so does the factor.

`lean_step_problem` decides, from the config and the process layout: the lean step where it is this computation
(`lean_step: true`, the default), DeepSpeed's step elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from torch._utils import _unflatten_dense_tensors

from megatron.training.gradient_clipping import clip_by_norm_, clips_in_optimizer, counted_in_norm, global_norm
from megatron.training.phases import BACKWARD, DATA, FORWARD, LOSS_READOUT, OPTIMIZER, phase
from megatron.training.step import lm_loss

_ZERO_KEYS_OF_DEEPSPEED_STEP = ("offload_optimizer", "offload_param", "parameter_alignment", "round_robin_gradients")


def lean_step_problem(cfg, data_parallel_size: int) -> str | None:
    """Why `cfg`'s run, on `data_parallel_size` data-parallel ranks, takes DeepSpeed's step rather than the lean
    one; None when it takes the lean one."""
    zero = cfg.zero_optimization or {}
    stage = zero.get("stage", 0)
    if not cfg.lean_step:
        return "lean_step is false"
    if data_parallel_size > 1:
        return f"{data_parallel_size} data-parallel ranks reduce their gradients through DeepSpeed"
    if cfg.pipe_parallel_size > 1:
        return f"pipe_parallel_size {cfg.pipe_parallel_size}: the stages run DeepSpeed's pipeline schedule"
    if cfg.precision == "fp16":
        return "fp16's dynamic loss scaling is DeepSpeed's"
    if stage not in (0, 1) or (stage == 0 and not clips_in_optimizer(cfg)):
        return f"ZeRO stage {stage} in {cfg.precision} keeps its gradients and masters in DeepSpeed's own form"
    set_keys = [key for key in _ZERO_KEYS_OF_DEEPSPEED_STEP if zero.get(key)]
    if set_keys:
        return f"zero_optimization.{set_keys[0]} is DeepSpeed's own"
    return None


class _ZeroOneUpdate:
    """DeepSpeed's ZeRO stage 1 optimizer's update on one data-parallel rank, on its own buffers.

    The fp32 gradient buffers are allocated at each step, when the activations are gone, as DeepSpeed allocates
    its flat partition, except on a CPU: there an allocation this large is a fresh mapping whose first touch
    faults in every page, so the buffers are kept (a GPU's caching allocator reuses its blocks)."""

    def __init__(self, optimizer: DeepSpeedZeroOptimizer, max_norm: float, device: torch.device) -> None:
        self.optimizer, self.max_norm, self.device = optimizer, max_norm, device
        self.kept: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.params = []   # per group: the trained parameters, in their order in the flat buffer
        self.covered = []  # per group: how many leading elements of the flat buffer they fill (the rest is padding)
        for i, flat in enumerate(optimizer.bit16_groups_flat):
            params = optimizer.bit16_groups[i]
            offsets = [(p.data_ptr() - flat.data_ptr()) // p.element_size() for p in params]
            expected = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
            if offsets != expected or optimizer.partition_size[i] != flat.numel():
                raise ValueError(f"ZeRO parameter group {i} is not laid out as one rank's unpadded flat partition")
            self.params.append(params)
            self.covered.append(sum(p.numel() for p in params))
        self.all_params = [p for params in self.params for p in params]
        self.everything_counted = all(counted_in_norm(p) for p in self.all_params)
        self.counted = [counted_in_norm(p) for params in self.params for p in params]

    def _buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per group an fp32 buffer of its partition's size, zero past its parameters; each parameter's view."""
        if self.kept is not None:
            return self.kept
        flats, views = [], []
        for params, covered, size in zip(self.params, self.covered, self.optimizer.partition_size, strict=True):
            flat = torch.empty(size, dtype=torch.float32, device=self.device)
            flat[covered:].zero_()
            flats.append(flat)
            views += _unflatten_dense_tensors(flat[:covered], params)
        if self.device.type == "cpu":
            self.kept = flats, views
        return flats, views

    def step(self) -> torch.Tensor:
        """The update from the parameters' accumulated .grad; returns the global norm (a device tensor)."""
        opt = self.optimizer
        flats, views = self._buffers()
        grads = [p.grad for p in self.all_params]
        if any(grad is None for grad in grads):  # no part in this step's forward: a zero gradient, as DeepSpeed's
            grads = [torch.zeros_like(p) if grad is None else grad for p, grad in zip(self.all_params, grads)]
        torch._foreach_copy_(views, grads)
        counted = flats if self.everything_counted else [v for v, c in zip(views, self.counted) if c]
        norm = global_norm(counted, self.device)
        clip_by_norm_(flats, norm, self.max_norm)
        for master, flat in zip(opt.single_partition_of_fp32_groups, flats, strict=True):
            master.grad = flat
        _skipping_unless_finite(opt.optimizer, norm)
        opt._lazy_init_hp_params_optimizer_state()  # DeepSpeed links each parameter to its Adam state once
        for master in opt.single_partition_of_fp32_groups:
            master.grad = None
        torch._foreach_copy_([partitions[0] for partitions in opt.parallel_partitioned_bit16_groups],
                             opt.single_partition_of_fp32_groups)
        for p in self.all_params:
            p.grad = None
        return norm


class _TorchUpdate:
    """ZeRO stage 0 in fp32: our torch optimizer steps the module's parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float, device: torch.device) -> None:
        self.optimizer, self.max_norm, self.device = optimizer, max_norm, device
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.counted = [p for p in self.params if counted_in_norm(p)]

    def step(self) -> torch.Tensor:
        norm = global_norm([p.grad for p in self.counted if p.grad is not None], self.device)
        clip_by_norm_([p.grad for p in self.params if p.grad is not None], norm, self.max_norm)
        _skipping_unless_finite(self.optimizer, norm)
        for p in self.params:
            p.grad = None
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
        optimizer = engine.optimizer
        if isinstance(optimizer, DeepSpeedZeroOptimizer):
            self.update = _ZeroOneUpdate(optimizer, cfg.gradient_clipping, engine.device)
            for hook in optimizer._grad_acc_hooks:  # its gradient bucketing, which this step replaces
                hook.remove()
            optimizer._grad_acc_hooks = []
        elif isinstance(optimizer, torch.optim.Optimizer) and clips_in_optimizer(cfg):
            self.update = _TorchUpdate(optimizer, cfg.gradient_clipping, engine.device)
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
        for _ in range(self.accumulation):
            with phase(DATA):
                batch = next(batches).to(self.device)
            with phase(FORWARD):
                logits = self.module(batch[:, :-1])
            loss = lm_loss(logits, batch[:, 1:])
            with phase(BACKWARD):
                (loss / self.accumulation).backward()
            total += loss.detach()
        with phase(OPTIMIZER):
            norm = self.update.step()
        with phase(LOSS_READOUT):
            loss_value, norm_value = torch.stack([total / self.accumulation, norm]).tolist()
        applied = math.isfinite(norm_value)
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
