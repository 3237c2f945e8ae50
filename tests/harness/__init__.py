"""Shared test machinery: helpers more than one test file uses, and the real-Slurm cluster fixture."""
