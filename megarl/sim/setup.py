"""From a setup (YAML) to the two simulations: the colocated sync baseline and the split async run.

Setup keys (``configs/sim/*.yaml``; every number may carry a reason under ``sources:``):
  model, hardware, steps, batch.{samples, prompt_tokens}, lengths.{kind, ..., max_new_tokens, seed},
  efficiency.{...} (overrides of ``workload.Efficiency``),
  sync.{gpus, model_parallel.{tp, pp} | trainer.{tp, pp} + generator.{tp, pp}, generator.{dtype, batching},
       resident_bytes_per_param, resident_mp_bytes_per_param, sync_method},
  async.{trainer.{gpus, tp, pp}, generator.{gpus, tp, dtype}, max_policy_lag, round_budget, sync_method},
  paper.{sync_step_s, async_step_s, ratio, source}.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import yaml

from megarl.sim.events import SimConfig, SimResult, simulate
from megarl.sim.hardware import Hardware, get_hardware
from megarl.sim.workload import (Efficiency, LengthDist, ModelCost, decode_cost, load_dims,
                                 sync_seconds, train_seconds)

SYNC_METHODS = ("ddma", "gather_broadcast")
# One model-parallel layout for both phases: the generator decodes from the trainer's own shards,
# so nothing moves between the phases (LlamaRL's synchronous baseline, arXiv 2505.24034).
IN_PLACE = "in_place"


@dataclasses.dataclass
class ModeRun:
    name: str
    layout: str
    gpus: int
    result: SimResult
    sync_detail: dict
    lag0: SimResult | None = None  # the same layout run serially: its T_gen, T_train for the overlap bound


def load_setup(path: str | Path) -> dict:
    """A setup YAML as a dict; ValueError (one line: `megarl simulate` exits 2) when it is not one."""
    if Path(path).is_dir():
        raise ValueError(f"{path}: is a folder, not a setup YAML file (configs/sim/*.yaml)")
    try:
        d = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    missing = [k for k in ("sync", "async") if not isinstance(d, dict) or not isinstance(d.get(k), dict)]
    if not isinstance(d, dict) or not isinstance(d.get("model"), str) or missing:
        train = " (a training config? run it with `megarl train`)" if isinstance(d, dict) and "trainer" in d else ""
        raise ValueError(f"{path}: not a simulate setup{train}: expected a mapping with 'model' (a model name or "
                         f"config.json path), 'sync' and 'async' sections, as configs/sim/*.yaml")
    d.setdefault("name", Path(path).stem)
    return d


def _lengths(spec: Mapping[str, Any]):
    dist = LengthDist(spec)
    return dist, dist.next


def _sync_cost(dims, trainer: tuple[int, int, int], gen: tuple[int, int], dtype: str, method: str,
               hw: Hardware) -> tuple[float, dict]:
    if method not in SYNC_METHODS:
        raise ValueError(f"sync_method={method!r}: expected one of {SYNC_METHODS}")
    detail = sync_seconds(dims, trainer, gen, dtype, hw.ib_bytes_per_s)
    detail["method"] = method
    return (detail["ddma_s"] if method == "ddma" else detail["gather_broadcast_s"]), detail


def _batching(gen: Mapping[str, Any], where: str) -> bool:
    """True for static batches (HF ``generate``), False for continuous batching (vLLM)."""
    mode = gen.get("batching", "continuous")
    if mode not in ("continuous", "static"):
        raise ValueError(f"{where}.batching={mode!r}: expected continuous or static")
    return mode == "static"


def _split(total: int, tp: int, pp: int, what: str) -> int:
    if total % (tp * pp):
        raise ValueError(f"{what}: {total} GPUs is not a multiple of TP{tp} x PP{pp}")
    return total // (tp * pp)


def run_setup(setup: Mapping[str, Any], steps: int | None = None) -> dict:
    """Simulate both modes of one setup; returns everything the report prints."""
    hw = get_hardware(setup.get("hardware", "h100_sxm"))
    eff = Efficiency.from_dict(setup.get("efficiency"))
    dims = load_dims(setup["model"])
    cost = ModelCost.of(dims)
    steps = int(steps or setup.get("steps", 10))
    b = setup["batch"]
    batch, prompt = int(b["samples"]), int(b["prompt_tokens"])
    mean_len = LengthDist(setup["lengths"]).mean()
    mean_ctx = prompt + mean_len
    train = lambda gpus: (lambda members: train_seconds(cost, hw, eff, gpus, [m.prompt + m.length for m in members]))  # noqa: E731

    # -- sync: colocated baseline (all GPUs generate, then all train, then reshard in place) --------
    s = setup["sync"]
    G = int(s["gpus"])
    mp = s.get("model_parallel")
    if mp is not None:  # one global model-parallel layout: both phases on the same shards
        if "trainer" in s or {"tp", "pp"} & set(s.get("generator") or {}):
            raise ValueError("sync.model_parallel sets both phases' layout: drop sync.trainer and "
                             "sync.generator.{tp, pp}")
        st = {"tp": int(mp["tp"]), "pp": int(mp.get("pp", 1))}
        sg = {**(s.get("generator") or {}), **st}
        method = s.get("sync_method", IN_PLACE)
        if method != IN_PLACE:
            raise ValueError(f"sync.model_parallel: the phases share their shards, sync_method must be "
                             f"{IN_PLACE!r}, not {method!r}")
    else:
        st, sg = s["trainer"], s["generator"]
        method = s.get("sync_method", "ddma")
    mp_size = st["tp"] * st.get("pp", 1)
    t_dp = _split(G, st["tp"], st.get("pp", 1), "sync.trainer")
    g_rep = _split(G, sg["tp"], sg.get("pp", 1), "sync.generator")
    # training state left resident while generating: sharded over all GPUs (e.g. ZeRO-3, or a
    # distributed optimizer's fp32 master + Adam) and over the model-parallel group only (e.g. fp32 grads)
    resident = (float(s.get("resident_bytes_per_param", 16)) * cost.params / G
                + float(s.get("resident_mp_bytes_per_param", 0)) * cost.params / mp_size)
    static = _batching(sg, "sync.generator")
    max_ctx = prompt + LengthDist(setup["lengths"]).max_new
    s_cost = decode_cost(cost, hw, eff, sg["tp"], sg.get("pp", 1), sg.get("dtype", "bf16"),
                         max_ctx if static else mean_ctx, resident, static=static)
    if method == IN_PLACE:
        if mp is None:
            raise ValueError(f"sync.sync_method={IN_PLACE!r} needs sync.model_parallel (one layout for both phases)")
        s_sync, s_detail = 0.0, {"method": IN_PLACE, "ddma_s": 0.0, "gather_broadcast_s": 0.0,
                                 "dtype": sg.get("dtype", "bf16"),
                                 "planned_as": f"none: generation reads the trainer's TP{st['tp']}xPP{st['pp']} shards"}
    else:
        s_sync, s_detail = _sync_cost(dims, (st["tp"], st.get("pp", 1), t_dp), (sg["tp"], g_rep),
                                      sg.get("dtype", "bf16"), method, hw)
    _, nxt = _lengths(setup["lengths"])
    sync_cfg = SimConfig(batch=batch, prompt_tokens=prompt, max_policy_lag=0, steps=steps, replicas=g_rep,
                         cost=s_cost, lengths=nxt, train_s=train(G), sync_s=s_sync,
                         reward_s=float(setup.get("reward_s", 0.0)))
    sync_run = ModeRun("sync", f"colocated {G} GPUs{f', one model-parallel size {mp_size}' if mp is not None else ''}: "
                       f"train TP{st['tp']}xPP{st.get('pp', 1)}xDP{t_dp}, generate "
                       f"TP{sg['tp']}xPP{sg.get('pp', 1)} x {g_rep} ({sg.get('dtype', 'bf16')}, "
                       f"{'static' if static else 'continuous'} batching)", G,
                       simulate(sync_cfg), s_detail)

    # -- async: disjoint trainer and generator GPUs (LlamaRL) -----------------------------------------
    a = setup["async"]
    at, ag = a["trainer"], a["generator"]
    a_dp = _split(int(at["gpus"]), at["tp"], at.get("pp", 1), "async.trainer")
    a_rep = _split(int(ag["gpus"]), ag["tp"], 1, "async.generator")
    # the async trainer keeps its state to itself: generator GPUs hold weights + KV only
    a_static = _batching(ag, "async.generator")
    a_cost = decode_cost(cost, hw, eff, ag["tp"], 1, ag.get("dtype", "bf16"),
                         prompt + LengthDist(setup["lengths"]).max_new if a_static else mean_ctx, 0.0, static=a_static)
    a_sync, a_detail = _sync_cost(dims, (at["tp"], at.get("pp", 1), a_dp), (ag["tp"], a_rep),
                                  ag.get("dtype", "bf16"), a.get("sync_method", "ddma"), hw)
    lag = int(a.get("max_policy_lag", 1))
    rb = a.get("round_budget")

    def acfg(lag_: int, rb_) -> SimConfig:
        _, nx = _lengths(setup["lengths"])
        return SimConfig(batch=batch, prompt_tokens=prompt, max_policy_lag=lag_, steps=steps, replicas=a_rep,
                         cost=a_cost, lengths=nx, train_s=train(int(at["gpus"])), sync_s=a_sync,
                         reward_s=float(setup.get("reward_s", 0.0)), round_budget=rb_)

    async_run = ModeRun("async", f"trainer {at['gpus']} GPUs TP{at['tp']}xPP{at.get('pp', 1)}xDP{a_dp}, generator "
                        f"{ag['gpus']} GPUs TP{ag['tp']} x {a_rep} ({ag.get('dtype', 'bf16')}), lag {lag}, "
                        f"round budget {rb}", int(at["gpus"]) + int(ag["gpus"]), simulate(acfg(lag, rb)), a_detail,
                        lag0=simulate(acfg(0, None)))
    return {"setup": dict(setup), "hardware": hw, "efficiency": eff, "cost": cost, "mean_len": mean_len,
            "sync": sync_run, "async": async_run, "decode": {"sync": s_cost, "async": a_cost},
            "ratio": sync_run.result.step_mean_s / async_run.result.step_mean_s}


__all__ = ["load_setup", "run_setup", "ModeRun"]
