"""Our rank layout as DeepSpeed's process topology, for its pipeline engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.mpu.initialize import ParallelLayout

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


def pipeline_topology(layout: ParallelLayout) -> PipeModelDataParallelTopology:
    """DeepSpeed's topology with our sizes. It numbers ranks row-major over the axes (pipe, data, model):
    rank = (pipe · data_size + data) · tensor_size + model, the layout of initialize.py, so the pipeline,
    data-parallel and tensor-parallel groups its engine builds hold the same ranks as ours
    (tests/test_pipeline_model.py compares every rank)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=layout.pipe_size, num_mp=layout.tensor_size, num_dp=layout.data_size)
