"""Growing a model's parameter tokens (docs/growth.md): the plan (plan.py), the grown state of each entry
(grow.py), the grown or re-sharded checkpoint written (grow_checkpoint.py), a checkpoint re-sharded for the layout
a run resumes on (reshard_on_resume.py), growing inside a training run (partial_init.py) and keeping the old
tokens fixed (freezing.py).
Reading and writing the checkpoints themselves is megatron/checkpoint's."""
