#!/usr/bin/env python
"""Per-rank entry point; started by deepy.py (through DeepSpeed's launcher) on every process.

    python deepy.py train.py configs/demo.yml
"""

from __future__ import annotations

import argparse
import base64
import warnings
import zlib

from megatron.config import Config
from megatron.launch.process_group import leave_process_group
from megatron.training import pretrain

# DeepSpeed's ZeRO calls a torch collective that torch marks deprecated; nothing for users to act on.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megatron_config", required=True, help="resolved config from deepy.py (zlib-compressed JSON, base64)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher")
    args = parser.parse_args()
    cfg = Config.from_json(zlib.decompress(base64.urlsafe_b64decode(args.megatron_config)).decode())
    pretrain(cfg)
    leave_process_group()


if __name__ == "__main__":
    main()
