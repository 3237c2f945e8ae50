"""Report for ``megarl simulate``: every assumption with its source, per-step phase times of both modes,
the sync/async ratio beside the analytic overlap bound and the paper's figure; JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

PROTOCOL = [
    ("protocol.sync_mode", "colocated: all GPUs generate the batch, then all train, then reshard in place (lag 0)",
     "the synchronous on-policy baseline LlamaRL compares against (arXiv 2505.24034)"),
    ("protocol.async_mode", "disjoint trainer / generator GPUs; batch k+1 generated while batch k trains",
     "LlamaRL design (DESIGN.md 'Async and off-policy')"),
    ("protocol.admission", "at most (max_policy_lag + version + 1) x batch samples admitted",
     "DESIGN.md admission control (AReaL-style)"),
    ("protocol.dispatch", "one FIFO queue; a replica takes the next sample when a slot frees",
     "assumption: work-conserving dispatch (vLLM continuous batching per replica)"),
    ("protocol.sync_pauses_generator", "every replica stops at its next step boundary for the whole sync",
     "assumption: receivers swap weights in place (DDMA), so decoding pauses"),
    ("protocol.pp_decode", "pipeline stages decode in turn (no micro-batching)",
     "assumption: a baseline generating with PP does not pipeline decode steps"),
    ("protocol.partial_rollouts", "a sample that made round_budget tokens under one weight version leaves its "
     "slot, is re-queued first after the next sync and re-prefilled; batch = first B samples to finish",
     "LlamaRL / Kimi k1.5 partial rollouts (DESIGN.md)"),
    ("protocol.sync_link", "DDMA: busiest rank's bytes / IB bandwidth per GPU; gather+broadcast: rank 0's link",
     "megarl plan-sync projection (megarl/ddma/project.py)"),
    ("protocol.fp8_bytes", "fp8 weights and wire = 1 byte/element (scales ignored), KV cache bf16",
     "megarl/ddma/project.py; vLLM kv_cache_dtype='auto' keeps the model's activation dtype"),
]


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and key != "lengths" and k not in ("trainer", "generator", "model_parallel"):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def assumptions(out: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """Every number the simulation rests on, as ``(name, value, source)``."""
    setup = out["setup"]
    srcs = setup.get("sources") or {}
    rows: list[tuple[str, str, str]] = []
    for key, val in _flat({k: v for k, v in setup.items() if k not in ("sources", "paper", "name")}).items():
        src = srcs.get(key) or srcs.get(key.split(".")[0]) or "setup yaml (no reason given)"
        rows.append((f"setup.{key}", json.dumps(val) if not isinstance(val, str) else val, src))
    d = out["cost"].dims
    rows.append(("model.dims", f"{d.num_layers} layers, hidden {d.hidden_size}, {d.num_heads} heads / "
                 f"{d.num_kv_heads} KV heads, ffn {d.ffn_hidden_size}, vocab {d.vocab_size}", f"HF config {setup['model']}"))
    rows.append(("model.params", f"{out['cost'].params / 1e9:.2f} B ({out['cost'].matmul_params / 1e9:.2f} B in matmuls"
                   + (f", {out['cost'].active_params / 1e9:.2f} B active per token)" if out['cost'].dims.is_moe else ")"),
                 "counted from the HF tensor shapes (megarl.models.layouts.hf_tensor_shapes)"))
    rows.append(("lengths.mean", f"{out['mean_len']:.0f} tokens", "mean of 20,000 draws of the length distribution"))
    rows += out["hardware"].assumptions()
    overridden = set((setup.get("efficiency") or {}).keys())
    rows += out["efficiency"].assumptions(overridden)
    for mode in ("sync", "async"):
        c = out["decode"][mode]
        rows.append((f"derived.{mode}.decode", f"{c.max_seqs} slots/replica, weights read {c.mem_base_s * 1e3:.2f} ms/step, "
                     f"TP comm {c.comm_base_s * 1e3:.2f} ms/step + {c.comm_per_seq_s * 1e6:.2f} us/seq",
                     "workload.decode_cost from hardware x efficiency x model dims"))
        sd = out[mode].sync_detail
        if sd["method"] == "in_place":
            rows.append((f"derived.{mode}.weight_sync", "0 s (in place)", sd["planned_as"]))
            continue
        rows.append((f"derived.{mode}.weight_sync", f"DDMA {sd['ddma_s']:.3f} s, gather+broadcast "
                     f"{sd['gather_broadcast_s']:.3f} s ({sd['dtype']}); used: {sd['method']}",
                     f"megarl.ddma planner/projection, {sd['planned_as']}"))
    return rows + PROTOCOL


def summary(out: Mapping[str, Any]) -> dict:
    """The JSON-serialisable result of one setup."""
    a = out["async"]
    lag0 = a.lag0.phase_medians()
    t_gen, t_train = lag0["generate_span_s"], lag0["train_s"] + lag0["sync_s"]
    paper = out["setup"].get("paper") or {}
    res = {"name": out["setup"]["name"],
           "sync": {"layout": out["sync"].layout, "gpus": out["sync"].gpus, **out["sync"].result.phase_medians(),
                    "weight_sync": out["sync"].sync_detail},
           "async": {"layout": a.layout, "gpus": a.gpus, **a.result.phase_medians(), "weight_sync": a.sync_detail,
                     "serial_same_layout": lag0},
           "ratio": out["ratio"],
           "overlap_bound": {"formula": "(T_gen + T_train) / max(T_gen, T_train), async layout, T_train incl. sync",
                             "t_gen_s": t_gen, "t_train_s": t_train,
                             "value": (t_gen + t_train) / max(t_gen, t_train)},
           "paper": paper,
           "assumptions": [{"name": n, "value": v, "source": s} for n, v, s in assumptions(out)]}
    if paper.get("ratio"):
        res["ratio_vs_paper"] = out["ratio"] / paper["ratio"] - 1
        res["within_30pct"] = abs(res["ratio_vs_paper"]) <= 0.30
        if not res["within_30pct"]:
            res["gap"] = gap_note(res)
    return res


def gap_note(res: Mapping[str, Any]) -> str:
    """Which side of the ratio departs from the paper, by comparing absolute step times."""
    p = res["paper"]
    s_err = res["sync"]["step_s"] / p["sync_step_s"] - 1 if p.get("sync_step_s") else None
    a_err = res["async"]["step_s"] / p["async_step_s"] - 1 if p.get("async_step_s") else None
    if s_err is None or a_err is None:
        return "the paper's absolute step times are not in the setup: cannot say which side differs"
    side = "sync baseline" if abs(s_err) > abs(a_err) else "async run"
    sy, asy = res["sync"], res["async"]
    # per phase: what the paper's step leaves for generation once the modelled train + sync are taken
    s_gen_left = p["sync_step_s"] - sy["train_s"] - sy["sync_s"]
    return (f"predicted sync step {sy['step_s']:.1f} s vs paper {p['sync_step_s']} s ({s_err:+.0%}); "
            f"async {asy['step_s']:.1f} s vs {p['async_step_s']} s ({a_err:+.0%}): the {side} differs most. "
            f"Per phase, sync: generate {sy['generate_span_s']:.1f} s + train {sy['train_s']:.1f} s + sync "
            f"{sy['sync_s']:.2f} s; at the modelled train + sync the paper's step leaves {s_gen_left:.1f} s for "
            f"generation, {s_gen_left / max(sy['generate_span_s'], 1e-9):.1f}x the modelled decode. Async: generate "
            f"span {asy['generate_span_s']:.1f} s, train {asy['train_s']:.1f} s, sync {asy['sync_s']:.2f} s. The "
            f"baseline is modelled idealised (the async run's engine and MFU, no resharding), and GPU counts, "
            f"batch and reply lengths are assumptions (not found in the reachable sources)")


def _fmt_phases(name: str, ph: Mapping[str, Any]) -> str:
    return (f"  {name:<6} step {ph['step_s']:8.2f} s (median {ph['step_median_s']:.2f})  generate span "
            f"{ph['generate_span_s']:7.2f} s  train {ph['train_s']:7.2f} s  weight sync {ph['sync_s']:6.3f} s  "
            f"trainer wait {ph['trainer_wait_s']:6.2f} s  generator busy {ph['generator_busy_frac']:.0%}  "
            f"max staleness {ph['max_staleness']}  ({ph['events']} events)")


def format_summary(res: Mapping[str, Any], with_assumptions: bool = True) -> str:
    lines = [f"== {res['name']} =="]
    if with_assumptions:
        lines.append("assumptions (name = value  [source]):")
        lines += [f"  {a['name']} = {a['value']}  [{a['source']}]" for a in res["assumptions"]]
    lines.append(f"sync:  {res['sync']['layout']}")
    lines.append(f"async: {res['async']['layout']}")
    lines.append("per-step phases (steady state):")
    lines.append(_fmt_phases("sync", res["sync"]))
    lines.append(_fmt_phases("async", res["async"]))
    ob = res["overlap_bound"]
    lines.append(f"sync/async ratio (DES): {res['ratio']:.2f}x   analytic overlap bound of the async layout: "
                 f"{ob['value']:.2f}x (T_gen {ob['t_gen_s']:.2f} s, T_train+sync {ob['t_train_s']:.2f} s)")
    p = res.get("paper") or {}
    if p.get("ratio"):
        lines.append(f"paper: {p.get('sync_step_s')} s -> {p.get('async_step_s')} s = {p['ratio']}x  "
                     f"[{p.get('source', '')}];  predicted/paper ratio {res['ratio_vs_paper']:+.0%} "
                     f"({'within' if res['within_30pct'] else 'outside'} 30%)")
        if res.get("gap"):
            lines.append(f"why: {res['gap']}")
    return "\n".join(lines)


def plot(results: list[Mapping[str, Any]], path: str | Path) -> None:
    """Step times of both modes per setup (paper's as markers), and the ratios."""
    from megarl.utils.plots import pyplot, save

    plt = pyplot("megarl simulate")
    if plt is None:
        return
    names = [r["name"] for r in results]
    x = range(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar([i - 0.2 for i in x], [r["sync"]["step_s"] for r in results], 0.4, label="sync (predicted)")
    ax1.bar([i + 0.2 for i in x], [r["async"]["step_s"] for r in results], 0.4, label="async (predicted)")
    for i, r in enumerate(results):
        p = r.get("paper") or {}
        if p.get("sync_step_s"):
            ax1.plot([i - 0.2, i + 0.2], [p["sync_step_s"], p["async_step_s"]], "kx", ms=8,
                     label="paper" if i == 0 else None)
    ax1.set_yscale("log")
    ax1.set_ylabel("step time (s)")
    ax1.set_xticks(list(x), names)
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [r["ratio"] for r in results], 0.4, label="DES")
    ax2.bar([i + 0.2 for i in x], [r["overlap_bound"]["value"] for r in results], 0.4, label="overlap bound")
    for i, r in enumerate(results):
        if (r.get("paper") or {}).get("ratio"):
            ax2.plot([i], [r["paper"]["ratio"]], "kx", ms=8, label="paper" if i == 0 else None)
    ax2.set_ylabel("sync / async")
    ax2.set_xticks(list(x), names)
    ax2.legend()
    save(fig, path)


def write_outputs(results: list[Mapping[str, Any]], out_dir: str | Path, stem: str) -> list[Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    js, png = d / f"{stem}.json", d / f"{stem}.png"
    js.write_text(json.dumps(results if len(results) != 1 else results[0], indent=2, default=str) + "\n")
    if results and "sync" in results[0]:
        plot(results, png)
        return [js, png]
    return [js]


__all__ = ["assumptions", "summary", "format_summary", "plot", "write_outputs"]
