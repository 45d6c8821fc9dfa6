"""The pretraining run: set up, train with periodic evaluation and checkpoints, summarise."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.checkpoint.rng_state import capture_rng_state, restore_rng_state
from megatron.checkpoint.save import save_checkpoint, should_save
from megatron.checkpoint.save_lock import hold_save_directory_for_the_run
from megatron.checkpoint.selection import resume_tag
from megatron.config import ConfigError, check_run_inputs
from megatron.config.validate import raise_if_any
from megatron.formats.consolidated import CONFIG_NAME, read_config
from megatron.formats.deepspeed.compatibility import architecture_problems, holds_weights_only, tensor_problems
from megatron.formats.deepspeed.reader import open_checkpoint, read_checkpoint
from megatron.formats.deepspeed.resume import load_checkpoint
from megatron.growth.freezing import RunGrowth, freeze_old_param_tokens, restart_fp32_masters, run_growth
from megatron.growth.norm_ramp import NormRampApplier, norm_ramp
from megatron.growth.online import growth_line, growth_metrics, online_growth_record
from megatron.growth.partial_init import grow_into
from megatron.growth.plan import plan_growth
from megatron.growth.reshard_on_resume import tag_for_this_layout
from megatron.growth.schedule import GrowthSchedule, ScheduledGrowth, config_for_checkpoint
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model.compile import compile_backend, compile_layers
from megatron.model.pipeline import build_pipeline
from megatron.runtime.collectives import is_output_rank
from megatron.runtime.hang_watch import HangWatch, start_hang_watch
from megatron.runtime.process_group import initialize_distributed
from megatron.tokenizer import build_tokenizer, pad_vocab_size
from megatron.training.data import batch_iterator, build_datasets
from megatron.training.gradient_clipping import clips_in_optimizer, install_gradient_clipping
from megatron.training.lean_step import lean_step_problem, training_step_for
from megatron.training.learning_rates import LRSchedule, resume_lr_change
from megatron.training.metrics import MetricsWriter
from megatron.training.numerics import NonFiniteSteps, skip_nonfinite_updates
from megatron.training.optimizer import build_optimizer, deepspeed_config
from megatron.training.pattention_choice import resolve_pattention_impl
from megatron.training.phases import BOOKKEEPING, LOGGING, mark_pipeline, phase
from megatron.training.preemption import ExitConditions
from megatron.training.step import evaluate, lm_loss
from megatron.training.utilization import Utilization
from megatron.training.zero_check import zero_check_without_muon


def print_rank_0(message: str) -> None:
    if is_output_rank():
        print(message, flush=True)


@dataclass
class RunState:
    iteration: int = 0
    consumed_samples: int = 0
    last_train_loss: float | None = None
    last_valid_loss: float | None = None
    tokens_per_sec: float | None = None
    exit_reason: str | None = None


def run_model_args(cfg) -> TokenFormerArgs:
    """The model a run of `cfg` trains: the vocabulary padded from its tokenizer's (and set on `cfg`), the
    Pattention implementation decided (`auto` resolved for this device and run, and said)."""
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)
    cfg.padded_vocab_size = pad_vocab_size(
        tokenizer.vocab_size, cfg.make_vocab_size_divisible_by, cfg.model_parallel_size
    )
    model_args = TokenFormerArgs.from_config(cfg)
    impl, why = resolve_pattention_impl(cfg, model_args, get_accelerator())
    if why:
        print_rank_0(f"pattention_impl: auto -> {impl}: {why}")
    return dataclasses.replace(model_args, pattention_impl=impl)


def setup_model_and_engine(cfg, frozen_tokens: dict[str, int] | None = None, deepspeed_extra: dict | None = None,
                           lean: bool = False):
    """Model, optimizer and the DeepSpeed engine; `frozen_tokens`: the leading parameter tokens of each
    Pattention kind kept out of training (growth/freezing.py); `deepspeed_extra`: sections added to DeepSpeed's
    config (e.g. {"checkpoint": {"load_universal": True}}); `lean`: the run takes the lean step (lean_step.py),
    which clips itself."""
    model_args = run_model_args(cfg)
    # pipe_parallel_size 0: the plain model; 1 or more: DeepSpeed's pipeline engine, as in GPT-NeoX.
    pipelined = cfg.pipe_parallel_size >= 1
    if pipelined:
        topology = mpu.pipeline_topology(mpu.get_layout())
        model = build_pipeline(model_args, topology, lm_loss, cfg.pipe_partition_method)
    else:
        model = TokenFormerModel(model_args)
    if frozen_tokens:
        freeze_old_param_tokens(model, frozen_tokens, cfg.precision)
    backend = compile_backend(cfg.compile)
    if backend is not None:
        compile_layers(model, backend)
    optimizer = build_optimizer(model, cfg, get_accelerator().device_name())
    if clips_in_optimizer(cfg) and not lean:
        install_gradient_clipping(optimizer, cfg.gradient_clipping)
        skip_nonfinite_updates(optimizer)
    # mpu: DeepSpeed all-reduces gradients over our data-parallel group, counts each tensor-parallel
    # block once in the gradient norm and names checkpoint files by tensor-parallel rank. A pipeline
    # brings DeepSpeed's own groups instead, built from the same rank layout (mpu.pipeline_topology).
    with zero_check_without_muon():
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config={**deepspeed_config(cfg), **(deepspeed_extra or {})},
            dist_init_required=False,
            mpu=None if pipelined else mpu,
        )
    if pipelined:
        mark_pipeline(engine)
    return engine, optimizer, model_args


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        check_run_inputs(cfg)
        self.layout = initialize_distributed(cfg).layout
        if cfg.save and not cfg.eval_only:
            command = " ".join([cfg.user_script or "train.py", *(cfg.config_files or ())])
            hold_save_directory_for_the_run(cfg.save, command)
        self.growth_schedule = GrowthSchedule.from_config(cfg)
        # Collective; verifies every file of the chosen checkpoint, so it is done once.
        found = resume_tag(cfg.load)
        self.cfg = cfg = config_for_checkpoint(cfg, found)  # the model that checkpoint holds
        tag = tag_for_this_layout(cfg, found, mpu.get_data_parallel_world_size())
        self.growth = run_growth(cfg, tag)
        self._build_engine()
        self.schedule = LRSchedule.from_config(cfg)
        self.splits = build_datasets(cfg)
        self.state = RunState()
        self.exit_conditions = ExitConditions(cfg, self.engine.device)
        self.last_checkpoint = None if tag is None else Path(cfg.load) / tag
        if tag is not None and holds_weights_only(Path(cfg.load) / tag):
            tag_dir = Path(cfg.load) / tag
            raise_if_any(tensor_problems(tag_dir, cfg, cfg.padded_vocab_size, saved_layout=True)
                         or architecture_problems(tag_dir, cfg))
            grow_into(self.engine, cfg, read_checkpoint(tag_dir))  # into this run's layout, shapes unchanged
            print_rank_0(f"loaded the weights of {tag_dir} (it holds no optimizer state or iteration: a warm start "
                         "at iteration 0)")
        elif tag is not None:
            iteration, consumed = load_checkpoint(
                self.engine, cfg, tag, load_optimizer=not cfg.eval_only and self.growth.optimizer_state_fits)
            if not self.growth.optimizer_state_fits:
                restart_fp32_masters(self.engine)
            self.state.iteration, self.state.consumed_samples = iteration, consumed
            if iteration:
                print_rank_0(f"resumed from {cfg.load} at iteration {iteration} ({tag})")
                self._warn_on_a_schedule_change(Path(cfg.load) / tag, iteration)
            else:
                print_rank_0(f"loaded {cfg.load}/{tag} at iteration 0: a warm start")
        elif cfg.load and cfg.eval_only:
            raise ConfigError(f"eval_only: no checkpoint found in load={cfg.load!r} (no 'latest' file)")
        if cfg.pretrain_partial_init and tag is None:
            norms = grow_into(self.engine, cfg, open_checkpoint(cfg.pretrain_partial_init))
            self.growth = self.growth.grown_here(norms)
            print_rank_0(f"started from {cfg.pretrain_partial_init} grown to this model (pretrain_partial_init)")
        self.metrics = MetricsWriter(cfg, dist.get_rank(), resumed_at=self.state.iteration)
        self._after_load()
        print_rank_0(f"training step: DeepSpeed's ({self.deepspeed_step})" if self.deepspeed_step else
                     "training step: lean (megatron/training/lean_step.py)")
        if self.utilization.unknown_device:
            print_rank_0(f"MFU is not logged: {self.utilization.unknown_device!r} is not in the table of dense bf16 "
                         "peaks (megatron/training/utilization.py); set peak_tflops to its dense bf16 TFLOP/s")

    def _build_engine(self) -> None:
        """The engine (and what holds it) for the model `self.cfg` describes, before any state is loaded."""
        cfg = self.cfg
        self.deepspeed_step = lean_step_problem(cfg, get_accelerator().device_name())
        self.engine, self.optimizer, self.model_args = setup_model_and_engine(
            cfg, self.growth.frozen, lean=self.deepspeed_step is None)
        self.nonfinite_steps = NonFiniteSteps(self.engine, cfg, agreed=self.deepspeed_step is None)

    def _after_load(self) -> None:
        """What is built from the loaded engine: DeepSpeed's own load works on its step's state."""
        cfg = self.cfg
        self.train_step = training_step_for(self.engine, cfg, self.deepspeed_step)
        before_any_growth = self.growth.record is None and self.growth_schedule.growths  # the ramp starts at one
        ramp = None if before_any_growth else norm_ramp(cfg, self.growth.record)
        self.norm_ramp = None if ramp is None else NormRampApplier(self.engine.module, ramp)
        self.utilization = Utilization(
            get_accelerator(), flops_per_token(self.model_args, include_recompute=cfg.checkpoint_activations),
            flops_per_token(self.model_args, include_recompute=False), dist.get_world_size(), cfg.peak_tflops)

    def _grow(self, growth: ScheduledGrowth) -> None:
        """Collective: grow the model at a scheduled iteration (growth/online.py), from the checkpoint saved at
        it, into an engine built at the new counts; the random generators, the engine's step counters and
        everything else the run carries go on as they were."""
        started, state = time.perf_counter(), self.state
        source_dir = self.last_checkpoint
        if source_dir is None or re.fullmatch(rf"global_step{state.iteration}(-.*)?", source_dir.name) is None:
            raise RuntimeError(f"growth at iteration {state.iteration}: its checkpoint was not saved ({source_dir})")
        generators = capture_rng_state()
        counters = {name: getattr(self.engine, name) for name in ("global_steps", "global_samples", "skipped_steps")}
        source = read_checkpoint(source_dir)
        self.cfg = cfg = self.growth_schedule.config_at(state.iteration + 1)
        self.engine.destroy()
        del self.engine, self.optimizer, self.train_step, self.nonfinite_steps, self.norm_ramp
        gc.collect()
        get_accelerator().empty_cache()
        self._build_engine()
        plan = plan_growth(source.config, cfg)
        norms = grow_into(self.engine, cfg, source, plan)
        for name, value in counters.items():
            setattr(self.engine, name, value)
        record = online_growth_record(plan, self.growth.record, source_dir, norms, state.iteration)
        self.growth = RunGrowth(record)
        self._after_load()
        restore_rng_state(generators)
        seconds = time.perf_counter() - started
        self.metrics.write(growth_metrics(state.iteration, plan, seconds))
        print_rank_0(growth_line(state.iteration, plan, seconds))

    def _warn_on_a_schedule_change(self, tag_dir: Path, iteration: int) -> None:
        saved = tag_dir / CONFIG_NAME
        if saved.is_file():
            warning = resume_lr_change(read_config(saved), self.cfg, iteration)
            if warning:
                print_rank_0(f"warning: {warning}")

    def _iterator(self, dataset, consumed: int):
        return batch_iterator(
            dataset,
            consumed,
            self.cfg.train_micro_batch_size_per_gpu,
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            self.cfg.padded_vocab_size,
        )

    def evaluate(self) -> float | None:
        cfg = self.cfg
        if self.splits.valid is None or cfg.eval_iters == 0:
            return None
        if self.norm_ramp is not None:
            self.norm_ramp.apply(self.state.iteration)
        loss = evaluate(self.engine, self._iterator(self.splits.valid, 0), cfg.eval_iters)
        self.state.last_valid_loss = loss
        self.metrics.write({"iteration": self.state.iteration, "split": "valid", "lm_loss": loss})
        print_rank_0(f"validation at iteration {self.state.iteration} | lm_loss {loss:.4f}")
        return loss

    def train(self, until: int | None = None) -> RunState:
        """Train to iteration `until` (default: train_iters); a caller may run the loop in parts (benchmarks)."""
        cfg, state = self.cfg, self.state
        if state.iteration >= cfg.train_iters:
            print_rank_0(f"nothing to do: checkpoint is at iteration {state.iteration} >= train_iters")
            return state
        until = cfg.train_iters if until is None else min(until, cfg.train_iters)
        batches = self._iterator(self.splits.train, state.consumed_samples)
        tokens_per_step = cfg.train_batch_size * cfg.seq_length
        self.train_start = time.perf_counter()
        watch = start_hang_watch(cfg.hang_timeout, cfg.log_dir)
        try:
            self._steps(until, batches, tokens_per_step, watch)
        finally:
            if watch is not None:
                watch.stop()
        return state

    def _steps(self, until: int, batches, tokens_per_step: int, watch: HangWatch | None) -> None:
        """train's loop; `watch` (hang_watch.py, or None) sees each step end and is paused around evaluation and
        saves."""
        cfg, state = self.cfg, self.state
        unwatched = watch.paused if watch is not None else contextlib.nullcontext
        window_start, window_steps, first_window = self.train_start, 0, True
        while state.iteration < until:
            growth = self.growth_schedule.at(state.iteration)
            if growth is not None:  # after the checkpoint saved at this iteration, which holds the model before it
                with unwatched():
                    self._grow(growth)
                cfg = self.cfg  # the grown model's: its checkpoints' config.json
                window_start, window_steps, first_window = time.perf_counter(), 0, True
            with phase(BOOKKEEPING):
                lr = self.schedule.apply(self.optimizer, state.iteration)
                if self.norm_ramp is not None:
                    self.norm_ramp.apply(state.iteration)
            loss, grad_norm = self.train_step(batches)
            with phase(BOOKKEEPING):
                self.nonfinite_steps.check(state.iteration + 1, loss, grad_norm)
            state.iteration += 1
            if watch is not None:
                watch.step_done(state.iteration)
            state.consumed_samples += cfg.train_batch_size
            state.last_train_loss = loss
            if self.norm_ramp is not None:  # the n of this iteration, for evaluation and a checkpoint saved here
                self.norm_ramp.apply(state.iteration)
            window_steps += 1
            logged = state.iteration % cfg.log_interval == 0 or state.iteration == cfg.train_iters
            if logged:
                elapsed = time.perf_counter() - window_start
                with phase(LOGGING):
                    self._log_train(loss, lr, grad_norm, elapsed / window_steps, tokens_per_step, first_window)
                window_steps, first_window = 0, False
            with unwatched():
                if cfg.eval_interval and state.iteration % cfg.eval_interval == 0:
                    self.evaluate()
                if self._saves_at(state.iteration):
                    self._save()
            if logged:  # the next interval's time is training alone: evaluation and saving are not in it
                window_start = time.perf_counter()
            with phase(BOOKKEEPING):  # timed: its all-reduce is a collective of every step
                stop = state.iteration < cfg.train_iters and self._stops_early(unwatched)
            if stop:
                break

    def _saves_at(self, iteration: int) -> bool:
        """Whether the loop saves after `iteration`: as the config says, and before each scheduled growth."""
        return should_save(self.cfg, iteration) or self.growth_schedule.at(iteration) is not None

    def _save(self) -> None:
        """Collective: a checkpoint of this iteration; the models before the schedule's growths are never pruned."""
        self.last_checkpoint = save_checkpoint(
            self.engine, self.cfg, self.state.iteration, self.state.consumed_samples, self.growth.record_to_save(),
            lineage=[growth.iteration for growth in self.growth_schedule.growths])

    def _stops_early(self, unwatched: Callable[[], AbstractContextManager[None]]) -> bool:
        """Collective: on preemption, exit_interval or exit_duration_in_mins, save here (unless the loop just
        did; `unwatched` pauses the hang watch around the save) and tell the loop to stop."""
        cfg, state = self.cfg, self.state
        state.exit_reason = self.exit_conditions.reason(state.iteration)
        if state.exit_reason is None:
            return False
        if cfg.save and not self._saves_at(state.iteration):
            with unwatched():
                self._save()
        saved = f"; checkpoint saved in {cfg.save}" if cfg.save else "; no checkpoint (save is not set)"
        print_rank_0(f"exiting after iteration {state.iteration}: {state.exit_reason}{saved}")
        return True

    def _log_train(self, loss: float, lr: float, grad_norm: float | None, seconds_per_iter: float,
                   tokens_per_step: int, warmup: bool) -> None:
        """One line and one metrics record. The first interval of a process includes start-up work (the first
        steps' allocations and compilation), so it is marked, and the ETA uses the latest interval's speed."""
        tokens_per_sec = tokens_per_step / seconds_per_iter
        self.state.tokens_per_sec = tokens_per_sec
        utilization = self.utilization.record(tokens_per_sec)
        elapsed = time.perf_counter() - self.train_start
        remaining = (self.cfg.train_iters - self.state.iteration) * seconds_per_iter
        record = {
            "iteration": self.state.iteration,
            "split": "train",
            "lm_loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "ms_per_iter": seconds_per_iter * 1000,
            "includes_warmup": warmup,
            "tokens_per_sec": tokens_per_sec,
            **utilization,
            "consumed_samples": self.state.consumed_samples,
            "elapsed_s": elapsed,
            "eta_s": remaining,
        }
        self.metrics.write(record)
        norm_text = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
        print_rank_0(
            f"iteration {self.state.iteration:>6}/{self.cfg.train_iters} | lm_loss {loss:.4f} | lr {lr:.3e} | "
            f"grad_norm {norm_text} | {seconds_per_iter * 1000:.1f} ms/iter{' (incl. warm-up)' if warmup else ''} | "
            f"{tokens_per_sec:,.0f} tokens/s | {self.utilization.text(record)} | "
            f"elapsed {clock(elapsed)} | ETA {clock(remaining)}"
        )

    def summary(self) -> str:
        cfg, state = self.cfg, self.state
        lines = ["", "run summary"]

        def fmt(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        lines.append(f"  iterations        {state.iteration}")
        lines.append(f"  final train loss  {fmt(state.last_train_loss)}")
        lines.append(f"  final valid loss  {fmt(state.last_valid_loss)}")
        if state.tokens_per_sec is not None:
            lines.append(f"  tokens/s          {state.tokens_per_sec:,.0f}")
        if cfg.save:
            lines.append(f"  checkpoints       {cfg.save}")
        if cfg.log_dir:
            lines.append(f"  metrics           {cfg.log_dir}/metrics.jsonl")
        return "\n".join(lines)


def clock(seconds: float) -> str:
    """h:mm:ss"""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def pretrain(cfg) -> RunState:
    """Train (or, with eval_only, evaluate) the model described by `cfg`."""
    trainer = Trainer(cfg)
    if cfg.eval_only:
        trainer.evaluate()
    else:
        if cfg.eval_at_start:
            trainer.evaluate()
        trainer.train()
        just_evaluated = cfg.eval_interval and trainer.state.iteration % cfg.eval_interval == 0
        if not (trainer.state.exit_reason or just_evaluated):
            trainer.evaluate()
    print_rank_0(trainer.summary())
    trainer.metrics.close()
    trainer.exit_conditions.restore_signal_handlers()
    return trainer.state
