"""Progressive scaling: a plan of stages trained, grown and trained on, locally or as a SLURM job chain
(tools/progressive_scaling.py, docs/growth.md)."""
