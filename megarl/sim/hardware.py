"""Hardware models for ``megarl simulate``: per-GPU peak numbers, each with the document it comes from.

Peaks are datasheet numbers; what fraction of them a phase reaches is a separate, named assumption
(``megarl.sim.workload.Efficiency``), so a reader can tell a datasheet fact from a modelling choice.
The "cpu" model is not a datasheet: it is built from the phase times a ``megarl bench step`` run
measured on this machine (``cpu_from_bench``), since a 2-core box has no meaningful FLOP/s peak for
a Megatron + vLLM step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (SXM5 column; 'with sparsity' figures halved for dense)"
H200_DATASHEET = "NVIDIA H200 Tensor Core GPU datasheet (SXM column; 'with sparsity' figures halved for dense)"
DGX_H100 = "NVIDIA DGX H100 user guide: 8x ConnectX-7 400 Gb/s compute NICs, one per GPU"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak numbers of one accelerator (per GPU), and how GPUs are grouped into nodes."""

    name: str
    flops_bf16: float          # dense bf16 FLOP/s
    flops_fp8: float           # dense fp8 FLOP/s
    hbm_bytes_per_s: float     # HBM bandwidth
    hbm_bytes: float           # HBM capacity
    nvlink_bytes_per_s: float  # NVLink, one direction, per GPU
    ib_bytes_per_s: float      # scale-out NIC, one direction, per GPU
    gpus_per_node: int
    sources: Mapping[str, str]

    def assumptions(self) -> list[tuple[str, str, str]]:
        """``(name, value, source)`` for every number, for the report."""
        rows = [("flops_bf16", f"{self.flops_bf16 / 1e12:.1f} TFLOP/s", self.sources["flops"]),
                ("flops_fp8", f"{self.flops_fp8 / 1e12:.1f} TFLOP/s", self.sources["flops"]),
                ("hbm_bandwidth", f"{self.hbm_bytes_per_s / 1e12:.2f} TB/s", self.sources["hbm"]),
                ("hbm_capacity", f"{self.hbm_bytes / 1e9:.0f} GB", self.sources["hbm"]),
                ("nvlink_bandwidth", f"{self.nvlink_bytes_per_s / 1e9:.0f} GB/s per direction", self.sources["nvlink"]),
                ("ib_bandwidth", f"{self.ib_bytes_per_s / 1e9:.0f} GB/s per direction", self.sources["ib"]),
                ("gpus_per_node", str(self.gpus_per_node), self.sources["node"])]
        return [(f"hardware.{k}", v, s) for k, v, s in rows]


# H100 SXM5: 1,979 TFLOPS bf16 and 3,958 TFLOPS fp8 "with sparsity" -> 989.5 / 1,979 dense; 80 GB HBM3
# at 3.35 TB/s; NVLink 900 GB/s (both directions together -> 450 GB/s each way).
H100_SXM = Hardware(
    name="h100_sxm", flops_bf16=989.5e12, flops_fp8=1979e12, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9,
    nvlink_bytes_per_s=450e9, ib_bytes_per_s=50e9, gpus_per_node=8,
    sources={"flops": H100_DATASHEET, "hbm": H100_DATASHEET, "nvlink": H100_DATASHEET + " (900 GB/s total, halved)",
             "ib": DGX_H100 + " (400 Gb/s = 50 GB/s)", "node": DGX_H100})

# H200 SXM: the same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
H200_SXM = Hardware(
    name="h200_sxm", flops_bf16=989.5e12, flops_fp8=1979e12, hbm_bytes_per_s=4.8e12, hbm_bytes=141e9,
    nvlink_bytes_per_s=450e9, ib_bytes_per_s=50e9, gpus_per_node=8,
    sources={"flops": H200_DATASHEET, "hbm": H200_DATASHEET, "nvlink": H200_DATASHEET + " (900 GB/s total, halved)",
             "ib": "NVIDIA DGX H200 (ConnectX-7 400 Gb/s per GPU, as DGX H100) = 50 GB/s", "node": "DGX H200: 8 GPUs"})

HARDWARE = {h.name: h for h in (H100_SXM, H200_SXM)}


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"hardware {name!r}: expected one of {sorted(HARDWARE)} (or --calibrate for the cpu model)")
    return HARDWARE[name]


@dataclasses.dataclass(frozen=True)
class MeasuredPhases:
    """Median per-step phase times (seconds) of one mode of a ``megarl bench step`` run."""

    generate_s: float
    reward_s: float
    train_s: float
    sync_s: float
    step_s: float | None  # the measured median step, when the JSON has it
    idle_s: float = 0.0   # controller time outside the phases (logging, bookkeeping): on the trainer's path
    gen_source: str = "phases.generate_s"


@dataclasses.dataclass(frozen=True)
class CpuModel:
    """The "cpu" hardware model: measured phase times of both modes on this machine."""

    source: str
    sync: MeasuredPhases
    async_: MeasuredPhases | None
    measured_ratio: float | None
    max_policy_lag: int
    lag_source: str
    raw: Mapping[str, Any]

    def assumptions(self) -> list[tuple[str, str, str]]:
        rows = []
        for mode, ph in (("sync", self.sync), ("async", self.async_)):
            if ph is None:
                continue
            for k in ("generate_s", "reward_s", "train_s", "sync_s", "idle_s"):
                where = ph.gen_source if k == "generate_s" else f"phases.{k}"
                rows.append((f"cpu.{mode}.{k}", f"{getattr(ph, k):.3f} s", f"measured: {self.source} {mode}.{where}"))
        rows.append(("cpu.max_policy_lag", str(self.max_policy_lag), self.lag_source))
        return rows


def _median(values: Any) -> float | None:
    if isinstance(values, (int, float)):
        return float(values)
    if isinstance(values, list) and values:
        v = sorted(float(x) for x in values)
        n = len(v)
        return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
    return None


def _phases(mode: Mapping[str, Any], where: str) -> MeasuredPhases:
    ph = mode.get("phases") or {}
    missing = [k for k in ("generate_s", "train_s") if k not in ph]
    if missing:
        raise ValueError(f"{where}.phases lacks {missing}: megarl simulate --calibrate needs at least "
                         f"generate_s and train_s (reward_s, sync_s default to 0)")
    get = lambda k: float(_median(ph.get(k, 0.0)) or 0.0)  # noqa: E731 -- a value or a list of per-step values
    gen, gen_src = get("generate_s"), "phases.generate_s"
    busy = (mode.get("busy") or {}).get("generator_s")
    if where == "async" and busy is not None:
        # async phases.generate_s is the controller's exposed wait for rollouts, not the generation time
        gen, gen_src = float(_median(busy)), "busy.generator_s (phases.generate_s is the exposed wait)"
    step = mode.get("step_median_s")
    return MeasuredPhases(gen, get("reward_s"), get("train_s"), get("sync_s"),
                          float(step) if step is not None else _median(mode.get("step_s")), get("idle_s"), gen_src)


def _find_lag(cfg: Any) -> int | None:
    """``max_policy_lag`` anywhere in the bench's config block (flat or nested, e.g. controller.max_policy_lag)."""
    if isinstance(cfg, Mapping):
        if "max_policy_lag" in cfg and isinstance(cfg["max_policy_lag"], int):
            return cfg["max_policy_lag"]
        for v in cfg.values():
            lag = _find_lag(v)
            if lag is not None:
                return lag
    return None


def cpu_from_bench(path: str | Path) -> CpuModel:
    """Read a ``megarl bench step`` JSON. Keys read: ``{sync,async}.phases.{generate_s, reward_s,
    train_s, sync_s, idle_s}``, ``async.busy.generator_s`` (preferred over async generate_s, which is
    the exposed wait), ``{sync,async}.step_median_s`` or the median of ``step_s``, ``ratio``, and
    ``lag`` (top level) or ``max_policy_lag`` anywhere under ``config``. Values may be a number or a
    list of per-step values (-> median); missing reward/sync/idle are 0; the async block and ratio
    may be missing."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--calibrate {path}: no such file (write one with `megarl bench step`)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--calibrate {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("sync"), dict):
        raise ValueError(f"--calibrate {path}: expected a JSON object with a 'sync' block (megarl bench step output)")
    sync = _phases(raw["sync"], "sync")
    async_ = _phases(raw["async"], "async") if isinstance(raw.get("async"), dict) else None
    ratio = raw.get("ratio")
    if ratio is None and async_ and sync.step_s and async_.step_s:
        ratio = sync.step_s / async_.step_s
    lag = raw.get("lag") if isinstance(raw.get("lag"), int) else _find_lag(raw.get("config"))
    lag_src = f"{p.name} lag / config max_policy_lag" if lag is not None else \
        "not in the bench JSON; assumed 1 (megarl's async default: one step of overlap)"
    return CpuModel(source=p.name, sync=sync, async_=async_, measured_ratio=float(ratio) if ratio else None,
                    max_policy_lag=1 if lag is None else lag, lag_source=lag_src, raw=raw)


__all__ = ["Hardware", "H100_SXM", "H200_SXM", "HARDWARE", "get_hardware", "CpuModel", "MeasuredPhases",
           "cpu_from_bench"]
