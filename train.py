#!/usr/bin/env python
"""Per-rank entry point; started by deepy.py (through DeepSpeed's launcher) on every process.

    python deepy.py train.py configs/demo.yml
"""

from __future__ import annotations

import warnings

from megatron.host.startup import collector_paused

with collector_paused():  # torch and DeepSpeed: 400,000 objects (megatron/host/startup.py)
    from megatron.runtime.entry import run_rank
    from megatron.training import pretrain

# DeepSpeed's ZeRO calls a torch collective that torch marks deprecated; nothing for users to act on.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


if __name__ == "__main__":
    run_rank(pretrain, __doc__)
