"""CPU calibration that predicts: the cost model's per-phase constants fitted from micro-benchmarks
only, then ``megarl bench step``'s sync and async median steps predicted from them.

Constants (each printed with the bench file and field it came from):

- ``train_tok_s[k]``: trainer tokens/s on k cores, ``megarl bench trainer --threads k`` at the step's
  model, dtype, micro-batch, batch and row length (``--batch B --seq P+R``: the optimizer step, Adam
  over every parameter, is a cost per step, so a smaller batch amortises it over fewer tokens;
  measured: 64 x 72 tokens trained at ~190 tok/s on 2 cores in the step bench, 16 x 72 at 59-121 in
  the micro-bench): ``tokens_per_step / min(times_s.ours)``.
- ``gen_tok_s[k]``: generator tokens/s on k cores, ``megarl bench generator --threads-bind <k cores>``
  at the step bench's batch (``--prompts`` = prompts x samples) and reply length (``--new-tokens``,
  EOS ignored): ``max(generator_tok_s)``.
- ``sync_bytes_per_s``: ``megarl bench sync``'s ``bytes_landed_per_worker / best_seconds[method]``.

Each is the bench's fastest repeat, as the benches themselves report: on a shared machine the fastest
repeat is the least disturbed one, so a constant is what the hardware does, not how busy the
neighbours were (measured: 2-thread trainer repeats of 9.5 s and 34 s at load 10 on 2 cores).

Cost model per step of a workload (batch B sequences, prompt P tokens, reply R = max_new_tokens):

- generate on k cores: ``B x R / gen_tok_s[k]``: a batch decodes as long as its longest reply, and
  the step bench's early steps always have replies cut at R (``gen/truncated_frac`` > 0); a decode
  step's cost on CPU barely depends on how many sequences are still active (assumption: it is
  constant, so a shorter reply does not shorten the batch);
- train on k cores: ``B x (P + R) / train_tok_s[k]`` (rows padded to the longest, as the bench's full
  rows are);
- sync: ``model bytes / sync_bytes_per_s``; reward: ``reward_s`` (default 0: ~1 ms measured).

Sync mode (lag 0, every phase on all cores in turn): ``T_gen(all) + reward + T_train(all) + T_sync``.
Async (lag k, trainer and generator on their own cores): the DES (``events.simulate``) with the
per-core phases, generation cut into ``CAL_STEPS`` decode steps so a sync pauses it mid-way.
What the micro-benches cannot see: the two executors competing for memory bandwidth and caches
when they run side by side (async), and per-step controller overhead.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, Mapping

import yaml

from megarl.sim.events import SimConfig, simulate
from megarl.sim.hardware import cpu_from_bench
from megarl.sim.workload import DecodeCost

CAL_STEPS = 1000  # decode steps a generation phase is cut into, so a sync pauses it mid-way
SYNC_METHOD = "ddma_zero_copy_verify"  # the quickstart's sync: DDMA zero-copy, checksums every step


@dataclasses.dataclass(frozen=True)
class Constant:
    name: str
    value: float
    unit: str
    source: str  # bench file and field

    def row(self) -> tuple[str, str, str]:
        return self.name, f"{self.value:.4g} {self.unit}", self.source


def _read(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration: {what} bench {path} not found (run `megarl bench {what.split()[0]}`)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def trainer_constant(path: Path, cores: int, batch: int | None = None, seq: int | None = None) -> Constant:
    d = _read(path, "trainer")
    c = d.get("config") or {}
    if batch is not None and (c.get("batch"), c.get("seq")) not in ((None, None), (batch, seq)):
        raise ValueError(f"calibration: {path} trained {c.get('batch')} x {c.get('seq')} tokens; the workload's step is "
                         f"{batch} x {seq} (megarl bench trainer --batch {batch} --seq {seq})")
    times = (d.get("times_s") or {}).get("ours")
    if not times or "tokens_per_step" not in d:
        raise ValueError(f"calibration: {path} lacks tokens_per_step / times_s.ours (a `megarl bench trainer` JSON)")
    threads = (d.get("config") or {}).get("threads")
    if threads is not None and int(threads) != cores:
        raise ValueError(f"calibration: {path} ran with --threads {threads}, listed for {cores} core(s)")
    value = d["tokens_per_step"] / min(times)
    return Constant(f"train_tok_s[{cores}]", value, "tok/s",
                    f"{path.name}: tokens_per_step {d['tokens_per_step']} / min(times_s.ours) {min(times):.3f} s of "
                    f"{len(times)} (median {statistics.median(times):.3f} s) (megarl bench trainer, {cores} core(s))")


def generator_constant(path: Path, cores: int, batch: int, reply: int) -> Constant:
    d = _read(path, "generator")
    runs = d.get("generator_tok_s")
    if not runs:
        raise ValueError(f"calibration: {path} lacks generator_tok_s (a `megarl bench generator` JSON)")
    if d.get("prompts") not in (None, batch) or d.get("new_tokens") not in (None, reply):
        raise ValueError(f"calibration: {path} ran {d.get('prompts')} prompts x {d.get('new_tokens')} tokens; the "
                         f"workload needs {batch} x {reply} (megarl bench generator --prompts {batch} --new-tokens {reply})")
    bind = d.get("threads_bind", "?")
    return Constant(f"gen_tok_s[{cores}]", max(runs), "tok/s",
                    f"{path.name}: max(generator_tok_s) of {len(runs)} (median {statistics.median(runs):.1f}) (megarl "
                    f"bench generator, {batch} x {reply} tokens, threads_bind {bind})")


def sync_constant(path: Path, method: str = SYNC_METHOD) -> Constant:
    d = _read(path, "sync")
    best, nbytes = d.get("best_seconds") or {}, d.get("bytes_landed_per_worker")
    if method not in best or not nbytes:
        raise ValueError(f"calibration: {path} lacks best_seconds.{method} / bytes_landed_per_worker "
                         f"(a `megarl bench sync` JSON)")
    return Constant("sync_bytes_per_s", nbytes / best[method], "B/s",
                    f"{path.name}: bytes_landed_per_worker {nbytes} / best_seconds.{method} {best[method]:.4f} s "
                    f"(megarl bench sync)")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    batch: int            # sequences per step (prompts_per_step x n_samples)
    prompt_tokens: int    # tokens per prompt (chat template included)
    reply_tokens: int     # generator.max_new_tokens
    model_bytes: float    # bytes a sync moves (parameters x dtype bytes)
    lag: int = 1          # the async mode's max_policy_lag
    reward_s: float = 0.0
    sync_cores: int = 2   # sync mode: every phase on all cores
    async_trainer_cores: int = 1
    async_generator_cores: int = 1
    measured: str | None = None  # a `megarl bench step` JSON of this workload, to compare with


def phases(w: Workload, train_tok_s: Mapping[int, Constant], gen_tok_s: Mapping[int, Constant],
           sync_bps: Constant) -> dict[str, float]:
    """Per-phase seconds of one step in each mode's placement (the cost model above)."""
    train = lambda k: w.batch * (w.prompt_tokens + w.reply_tokens) / train_tok_s[k].value  # noqa: E731
    gen = lambda k: w.batch * w.reply_tokens / gen_tok_s[k].value  # noqa: E731
    return {"sync_generate_s": gen(w.sync_cores), "sync_train_s": train(w.sync_cores),
            "async_generate_s": gen(w.async_generator_cores), "async_train_s": train(w.async_trainer_cores),
            "sync_s": w.model_bytes / sync_bps.value, "reward_s": w.reward_s}


def predict(w: Workload, ph: Mapping[str, float], steps: int = 12) -> dict[str, float]:
    """Median-comparable steps: sync = phases in turn; async = the DES at the workload's lag."""
    sync_step = ph["sync_generate_s"] + ph["reward_s"] + ph["sync_train_s"] + ph["sync_s"]
    gen = ph["async_generate_s"]
    res = simulate(SimConfig(batch=1, prompt_tokens=0, max_policy_lag=w.lag, steps=steps, replicas=1,
                             cost=DecodeCost(mem_base_s=gen / CAL_STEPS, max_seqs=1), lengths=lambda: CAL_STEPS,
                             train_s=lambda m: ph["async_train_s"], sync_s=ph["sync_s"], reward_s=ph["reward_s"]))
    return {"sync_step_s": sync_step, "async_step_s": res.step_mean_s, "ratio": sync_step / res.step_mean_s}


def _workload(d: Mapping[str, Any]) -> Workload:
    fields = {f.name for f in dataclasses.fields(Workload)}
    unknown = set(d) - fields - {"benches"}
    if unknown:
        raise ValueError(f"calibration workload {d.get('name', '?')}: unknown key(s) {sorted(unknown)} "
                         f"(known: {sorted(fields)})")
    return Workload(**{k: v for k, v in d.items() if k in fields})


def calibrate_spec(path: str | Path, steps: int = 12) -> dict:
    """Read a calibration spec (YAML: ``benches`` {trainer: {cores: json}, generator: {cores: json},
    sync: json}, ``workloads`` [...], each workload optionally with its own ``benches``; paths relative
    to the spec), fit the constants, predict every workload and compare with its ``measured`` bench."""
    p = Path(path)
    if p.suffix == ".json":
        raise ValueError(f"--calibrate {path}: a bench_step JSON is what calibration predicts, not its input; pass a "
                         f"calibration spec (YAML naming the micro-bench JSONs and workloads, e.g. "
                         f"configs/sim/cpu_calibration.yaml)")
    if not p.is_file():
        raise ValueError(f"--calibrate {path}: no such file")
    spec = yaml.safe_load(p.read_text()) or {}
    if not isinstance(spec, dict) or not spec.get("workloads"):
        raise ValueError(f"--calibrate {path}: expected a mapping with 'benches' and 'workloads'")
    rel = lambda f: (p.parent / f) if not Path(f).is_absolute() else Path(f)  # noqa: E731
    out = {"source": p.name, "workloads": []}
    for wd in spec["workloads"]:
        w = _workload(wd)
        b = {**(spec.get("benches") or {}), **(wd.get("benches") or {})}
        try:
            train = {int(k): trainer_constant(rel(v), int(k), w.batch, w.prompt_tokens + w.reply_tokens)
                     for k, v in b["trainer"].items()}
            gen = {int(k): generator_constant(rel(v), int(k), w.batch, w.reply_tokens) for k, v in b["generator"].items()}
            sync_bps = sync_constant(rel(b["sync"]), b.get("sync_method", SYNC_METHOD))
        except KeyError as exc:
            raise ValueError(f"calibration workload {w.name}: benches lack {exc}") from None
        for k in {w.sync_cores, w.async_trainer_cores, w.async_generator_cores}:
            if k not in train or k not in gen:
                raise ValueError(f"calibration workload {w.name}: needs trainer and generator benches on {k} core(s)")
        ph = phases(w, train, gen, sync_bps)
        pred = predict(w, ph, steps)
        row = {"name": w.name, "workload": dataclasses.asdict(w),
               "constants": [c.row() for c in (*train.values(), *gen.values(), sync_bps)],
               "phases": ph, "predicted": pred, "measured": None, "error": None}
        if w.measured:
            m = cpu_from_bench(rel(w.measured))
            meas = {"sync_step_s": m.sync.step_s, "async_step_s": m.async_.step_s if m.async_ else None,
                    "ratio": m.measured_ratio, "source": w.measured}
            row["measured"] = meas
            row["error"] = {k: (pred[k] / meas[k] - 1) if meas.get(k) else None
                            for k in ("sync_step_s", "async_step_s", "ratio")}
        out["workloads"].append(row)
    return out


def format_spec_calibration(cal: Mapping[str, Any]) -> str:
    f = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    pct = lambda x: "" if x is None else f"  ({x:+.1%})"  # noqa: E731
    lines = [f"== CPU calibration from micro-benches ({cal['source']}) =="]
    for r in cal["workloads"]:
        w, p, m, e = r["workload"], r["predicted"], r["measured"] or {}, r["error"] or {}
        lines.append(f"-- {r['name']}: {w['batch']} sequences x ({w['prompt_tokens']} prompt + {w['reply_tokens']} "
                     f"reply) tokens, async lag {w['lag']}")
        lines.append("  constants (name = value  [benchmark]):")
        lines += [f"    {n} = {v}  [{s}]" for n, v, s in r["constants"]]
        ph = r["phases"]
        lines.append(f"  phases: sync generate {ph['sync_generate_s']:.2f} + train {ph['sync_train_s']:.2f}; async "
                     f"generate {ph['async_generate_s']:.2f} / train {ph['async_train_s']:.2f}; sync {ph['sync_s']:.3f} s")
        for key, label in (("sync_step_s", "sync step "), ("async_step_s", "async step"), ("ratio", "ratio     ")):
            unit = "x" if key == "ratio" else " s"
            lines.append(f"  {label}: predicted {f(p[key])}{unit}  measured {f(m.get(key))}{unit}{pct(e.get(key))}")
    return "\n".join(lines)


__all__ = ["CAL_STEPS", "Constant", "Workload", "calibrate_spec", "format_spec_calibration", "phases", "predict",
           "trainer_constant", "generator_constant", "sync_constant"]
