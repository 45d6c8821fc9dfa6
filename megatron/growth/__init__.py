"""Growing and re-sharding checkpoints, pretrain_partial_init and freezing old tokens (docs/growth.md)."""
