"""The training step on one data-parallel rank and one pipeline stage, without DeepSpeed's per-step machinery.

There DeepSpeed's engine pays for work that cannot change the result: its ZeRO-1 optimizer copies every
gradient into a bucket, divides it by a data-parallel size of 1, flattens the partition, takes each tensor's
norm of a float64 copy and reads the norm back to the host; its pipeline engine runs a one-stage schedule
with cloned inputs and gradient "reductions" over groups of one process. `LeanStep` runs the same step on
the same storage, owned by the same engine:

    per micro-batch  the engine's module forward, the loss, backward of loss / accumulation steps (autograd
                     sums the micro-batches' gradients in each parameter's .grad, in the model's dtype,
                     as DeepSpeed's ZeRO-1 does when no separate accumulation dtype is configured)
    at the boundary  the global norm (gradient_clipping.py: one multi-tensor norm in fp32, no float64 copy);
                     DeepSpeed's clipping rule on the device; AdamW on the fp32 masters, each parameter's view of
                     DeepSpeed's flat partition and moments (bf16 gradients widened to fp32 first, one
                     multi-tensor copy), skipped on the device when the norm is not finite, where DeepSpeed
                     skips it after reading the norm; the masters copied into the model's flat weights
    read back        the step's mean loss and the norm, in one transfer: the step's only wait for the device

Everything else stays DeepSpeed's: the model, the fp32 masters and Adam's moments live in its engine and
optimizer, which load and save checkpoints (global_steps, global_samples and skipped_steps advance here as its
own step advances them, so the files are those its step leaves). With ZeRO stage 0 in fp32 the update is our
torch optimizer's on the module's parameters. The loss, the weights and Adam's state are those of DeepSpeed's
step bit for bit wherever the clipping factor is 1 (tests/test_lean_step.py); where clipping scales the
gradients, the fp32 norm differs from DeepSpeed's float64-accumulated one in its last bits, and so does the factor.

`lean_step_problem` decides, from the config, the process layout and the device type: the lean step where it is
this computation (`lean_step: true`, the default, on a device with torch's fused AdamW), DeepSpeed's step elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from torch._utils import _unflatten_dense_tensors

from megatron.checkpoint.engine_optimizer import step_tensor
from megatron.training.gradient_clipping import clip_by_norm_, clips_in_optimizer, counted_in_norm, global_norm
from megatron.training.optimizer import has_fused_adamw
from megatron.training.phases import BACKWARD, DATA, FORWARD, LOSS_READOUT, OPTIMIZER, phase
from megatron.training.step import lm_loss

_ZERO_KEYS_OF_DEEPSPEED_STEP = ("offload_optimizer", "offload_param", "parameter_alignment", "round_robin_gradients")


def lean_step_problem(cfg, data_parallel_size: int, device_type: str) -> str | None:
    """Why `cfg`'s run, on `data_parallel_size` data-parallel ranks of devices of `device_type` ("cuda", "cpu",
    "hpu", ...), takes DeepSpeed's step rather than the lean one; None when it takes the lean one."""
    zero = cfg.zero_optimization or {}
    stage = zero.get("stage", 0)
    if not cfg.lean_step:
        return "lean_step is false"
    if not has_fused_adamw(device_type):
        return f"torch has no fused AdamW on {device_type}, which the lean step needs to skip a step on the device"
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
    """DeepSpeed's ZeRO stage 1 optimizer's update on one data-parallel rank, on its own flat fp32 masters and Adam
    state, run as torch's fused AdamW kernel on each parameter's view of them: element for element the update
    DeepSpeed's step runs on the whole flat partition (the kernel's arithmetic is per element), without first
    flattening the gradients into the partition's layout. Gradients in fp32 go in as autograd left them; bf16 ones
    are widened into fp32 buffers first (allocated at each step, when the activations are gone, as DeepSpeed
    allocates its flat partition; kept on a CPU, where an allocation this large is a fresh mapping whose first
    touch faults in every page, while a GPU's caching allocator reuses its blocks)."""

    def __init__(self, optimizer: DeepSpeedZeroOptimizer, max_norm: float, device: torch.device) -> None:
        self.optimizer, self.max_norm, self.device = optimizer, max_norm, device
        self.groups = []  # per group: the trained parameters, in their order in the flat partition
        for i, flat in enumerate(optimizer.bit16_groups_flat):
            params = optimizer.bit16_groups[i]
            offsets = [(p.data_ptr() - flat.data_ptr()) // p.element_size() for p in params]
            if offsets != [sum(p.numel() for p in params[:k]) for k in range(len(params))] or (
                    optimizer.partition_size[i] != flat.numel()):
                raise ValueError(f"ZeRO parameter group {i} is not laid out as one rank's unpadded flat partition")
            self.groups.append(params)
        self.params = [p for params in self.groups for p in params]
        self.counted = [counted_in_norm(p) for p in self.params]
        self.widened = self.params[0].dtype != torch.float32
        self.kept_buffers: list[torch.Tensor] | None = None
        self.views: dict[tuple[int, str], list[torch.Tensor]] = {}

    def _fp32_gradient_buffers(self) -> list[torch.Tensor]:
        """One fp32 tensor per trained parameter, views of a buffer per group."""
        if self.kept_buffers is not None:
            return self.kept_buffers
        views = []
        for params in self.groups:
            flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=self.device)
            views += _unflatten_dense_tensors(flat, params)
        if self.device.type == "cpu":
            self.kept_buffers = views
        return views

    def _views(self, index: int, name: str, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter of group `index`'s view of `flat` (its master partition or an Adam moment of it), made
        again only when the tensor behind it is another (a checkpoint loaded into the optimizer)."""
        key = (index, name)
        cached = self.views.get(key)
        if cached is None or cached[0].data_ptr() != flat.data_ptr():
            cached = self.views[key] = list(_unflatten_dense_tensors(flat, self.groups[index]))
        return cached

    def _state(self, master: torch.Tensor, group: dict) -> dict:
        """The Adam state of flat partition `master`, created as torch's fused AdamW creates it at its first step."""
        inner = self.optimizer.optimizer
        if master not in inner.state:
            inner.state[master] = {"step": step_tensor(0, group, master),
                                   "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                                   "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}
        return inner.state[master]

    def step(self) -> torch.Tensor:
        """The update from the parameters' accumulated .grad; returns the global norm (a device tensor)."""
        opt = self.optimizer
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]  # unused: zero, as DeepSpeed
        if self.widened:
            fp32_grads = self._fp32_gradient_buffers()
            torch._foreach_copy_(fp32_grads, grads)
            grads = fp32_grads
        norm = global_norm([g for g, counted in zip(grads, self.counted) if counted], self.device)
        clip_by_norm_(grads, norm, self.max_norm)
        found_inf = (~torch.isfinite(norm)).float()
        first = 0
        for index, (master, group) in enumerate(zip(opt.single_partition_of_fp32_groups, opt.optimizer.param_groups,
                                                    strict=True)):
            state, count = self._state(master, group), len(self.groups[index])
            _fused_adamw(self._views(index, "master", master), grads[first:first + count],
                         self._views(index, "exp_avg", state["exp_avg"]),
                         self._views(index, "exp_avg_sq", state["exp_avg_sq"]), state["step"], group, found_inf)
            first += count
        opt._lazy_init_hp_params_optimizer_state()  # DeepSpeed links each parameter to its Adam state once
        torch._foreach_copy_([partitions[0] for partitions in opt.parallel_partitioned_bit16_groups],
                             opt.single_partition_of_fp32_groups)
        for p in self.params:
            p.grad = None
        return norm


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
            with phase(BACKWARD):  # x / 1 is x: no division without accumulation
                (loss / self.accumulation if self.accumulation > 1 else loss).backward()
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
