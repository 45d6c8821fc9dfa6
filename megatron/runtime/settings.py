"""The keys of the Config that a rank's runtime reads, as one typed value (as TokenFormerArgs is for the model).

Built once from the Config, so that the process group, the device, the seed and the parallel groups are
started from what this names, and a reader sees which keys decide them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron.config import Config
from megatron.config.run_inputs import INFERENCE_SCRIPTS


@dataclass(frozen=True)
class RuntimeSettings:
    """How a rank starts.

    `inference` (generate.py, eval.py): the processes hold one model replica split over model_parallel_size
    ranks, the checkpoint's pipeline stages merged when it is loaded, and torch.distributed is started alone:
    DeepSpeed's communication layer serves only the training engine.
    """

    script: str
    inference: bool
    launch_id: str | None
    distributed_backend: str
    world_size: int | None  # the processes the config was resolved for; None: not resolved by deepy.py
    model_parallel_size: int
    pipe_stages: int  # of the parallel layout: 1 for the plain model (pipe_parallel_size 0) and for inference
    seed: int
    deterministic: bool
    flash_backend: str

    @classmethod
    def from_config(cls, cfg: Config) -> RuntimeSettings:
        script = Path(cfg.user_script or "train.py").name
        inference = script in INFERENCE_SCRIPTS
        return cls(script=script, inference=inference, launch_id=cfg.launch_id,
                   distributed_backend=cfg.distributed_backend, world_size=cfg.world_size,
                   model_parallel_size=cfg.model_parallel_size,
                   pipe_stages=1 if inference else max(1, cfg.pipe_parallel_size), seed=cfg.seed,
                   deterministic=cfg.deterministic, flash_backend=cfg.flash_backend)

    def world_size_problem(self, started: int) -> str | None:
        """What is wrong with `started` processes for this run, and how to start the right number; None if
        nothing."""
        if self.inference and started != self.model_parallel_size:
            return (f"{self.script} runs one model replica split over model_parallel_size="
                    f"{self.model_parallel_size} processes, but {started} started: set num_gpus="
                    f"{self.model_parallel_size} (pipeline stages are merged when the checkpoint is loaded)")
        if self.world_size is not None and started != self.world_size:
            return (f"the config was resolved for {self.world_size} processes but {started} started; "
                    "launch through deepy.py, or set num_gpus to the number of processes")
        return None
