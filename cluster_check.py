#!/usr/bin/env python
"""Per-rank entry point of the cluster check, started by deepy.py on every process, as train.py is:

    python deepy.py cluster_check.py configs/1-5B.yml configs/local_setup.yml
    sbatch --nodes=4 tools/slurm/cluster_check.sbatch configs/1-5B.yml configs/local_setup.yml

Runs the sections of docs/cluster.md (environment, collectives, numerics, golden, throughput) with the config
the user is about to train with, writes log_dir/cluster_check.md and a summary, and exits 0 only if no section
failed.
"""

from __future__ import annotations

import warnings

from megatron.host.startup import collector_paused

with collector_paused():  # torch and DeepSpeed: 400,000 objects (megatron/host/startup.py)
    from megatron.cluster_check.check import run_cluster_check
    from megatron.runtime.entry import run_rank

# DeepSpeed's ZeRO calls a torch collective that torch marks deprecated; nothing for users to act on.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


if __name__ == "__main__":
    run_rank(run_cluster_check, __doc__)
