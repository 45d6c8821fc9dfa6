#!/usr/bin/env python
"""Per-rank entry point; started by deepy.py (through DeepSpeed's launcher) on every process.

    python deepy.py train.py configs/demo.yml
"""

from __future__ import annotations

import argparse
import sys
import warnings

from megatron.config import ConfigError
from megatron.launch import decode_config
from megatron.launch.process_group import leave_process_group, said_once
from megatron.training import pretrain

# DeepSpeed's ZeRO calls a torch collective that torch marks deprecated; nothing for users to act on.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megatron_config", required=True,
                        help="resolved config from deepy.py (zlib-compressed JSON, base64)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher")
    cfg = decode_config(parser.parse_args().megatron_config)
    try:
        pretrain(cfg)
    except ConfigError as error:
        return said_once(error)
    finally:
        leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
