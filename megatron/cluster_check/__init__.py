"""The check a user runs first on a new cluster: `python deepy.py cluster_check.py CONFIG.yml ...` (docs/cluster.md).

Five sections, one module each, run in order by check.py (run_cluster_check): environment (versions, devices,
shared paths), collectives (values, bus bandwidth, latency, stragglers), numerics (the config's layout against one
device, and its checkpoint re-sharded), golden (a stored loss curve reproduced on every device), throughput (the
config's model at the memory model's micro-batch). report.py writes log_dir/cluster_check.md and the console
summary.
"""
