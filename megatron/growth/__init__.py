"""Growing a model's parameter tokens (docs/growth.md): the plan (plan.py), the grown state of each entry
(grow.py), growing inside a training run (partial_init.py) and keeping the old tokens fixed (freezing.py).
Reading and writing the checkpoints themselves is megatron/checkpoint's."""
