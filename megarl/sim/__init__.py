"""``megarl simulate``: a discrete-event model of sync vs async RL steps at scale.

- ``hardware``: per-GPU peaks (datasheets) and the reader of a ``megarl bench step`` JSON (what calibration is compared with);
- ``workload``: FLOPs/bytes per token from an HF config, response lengths, phase costs, weight-sync
  cost from the DDMA planner;
- ``events``: the event-queue simulation of generator replicas, trainer and weight syncs;
- ``setup``: a YAML setup (``configs/sim/``) -> both modes;
- ``micro``: CPU calibration: per-phase constants from micro-benches -> predicted bench-step steps;
- ``report``: assumptions with sources, phases, ratio, JSON + PNG.
"""
