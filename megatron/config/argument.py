"""The resolved config as one command-line argument (`--megatron_config`), identical on every rank.

JSON compressed with zlib and base64-encoded (URL-safe alphabet), so it passes
unchanged through shells, pdsh, srun and mpirun.
"""

from __future__ import annotations

import base64
import zlib

from megatron.config.config import Config


def encode_config(cfg: Config) -> str:
    return base64.urlsafe_b64encode(zlib.compress(cfg.to_json().encode(), 9)).decode()


def decode_config(argument: str) -> Config:
    return Config.from_json(zlib.decompress(base64.urlsafe_b64decode(argument)).decode())
