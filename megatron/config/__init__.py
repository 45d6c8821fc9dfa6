"""Configuration: GPT-NeoX style YAML files -> one validated `Config` (see docs/config.md)."""

from megatron.config.config import Config
from megatron.config.inactive import inactive_keys, slow_keys
from megatron.config.loader import load_config
from megatron.config.run_inputs import check_run_inputs
from megatron.config.validate import ConfigError

__all__ = ["Config", "ConfigError", "check_run_inputs", "inactive_keys", "load_config", "slow_keys"]
