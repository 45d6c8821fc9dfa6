"""Stop a run early and cleanly: a preemption signal, exit_interval or exit_duration_in_mins.

Schedulers warn a job before killing it: SLURM sends SIGTERM at preemption
or the time limit (and SIGUSR1 ahead of time with --signal=USR1@SECONDS). The
handler only notes the signal. At every iteration boundary the ranks all-reduce
what they noted, so ranks that got no signal (or got it a step later) agree to
stop after the same iteration; the trainer then saves a checkpoint there and
exits 0 (Megatron's exit-signal handling). exit_interval and
exit_duration_in_mins end a run the same way (GPT-NeoX, Megatron).
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist


class ExitConditions:
    def __init__(self, cfg, device: torch.device) -> None:
        self._interval = cfg.exit_interval
        self._duration_minutes = cfg.exit_duration_in_mins
        self._started = time.monotonic()
        self._device = device
        self._received = 0
        self._previous_handlers = {}
        if cfg.exit_signal_handler:
            for name in cfg.exit_signals:
                number = signal.Signals[name]
                self._previous_handlers[number] = signal.signal(number, self._note)

    def _note(self, number: int, frame) -> None:
        self._received = number

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (the same answer on every rank), or None to go on. Collective when
        signals or a duration are watched."""
        if self._previous_handlers or self._duration_minutes is not None:
            elapsed = time.monotonic() - self._started
            late = self._duration_minutes is not None and elapsed >= 60 * self._duration_minutes
            flags = [self._received, int(late)]
            if dist.get_world_size() > 1:  # alone, a process needs neither the collective nor the device
                reduced = torch.tensor(flags, device=self._device)
                dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
                flags = reduced.tolist()
            if flags[0]:
                return f"{signal.Signals(int(flags[0])).name} received"
            if flags[1]:
                return f"exit_duration_in_mins={self._duration_minutes:g} reached"
        if self._interval and iteration % self._interval == 0:
            return f"exit_interval={self._interval} reached"
        return None

    def restore_signal_handlers(self) -> None:
        """Give the signals back their previous handlers (a finished run no longer saves on SIGTERM)."""
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers = {}
