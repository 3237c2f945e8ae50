"""Multi-node launch without Ray: Slurm env -> role map (slurm.py), launchers (launch.py), task entry (rank.py)."""
