"""Benchmark: the generator executor (vLLM) against raw vLLM and transformers on the same prompts.

Raw vLLM is ``vllm.LLM(...).generate`` in a process of its own, built from the very engine
arguments, environment (threads, KV cache) and sampling (greedy, sampled-token logprob) the
executor's replica uses: the ratio ``executor / raw`` is the cost of megarl's wrapper (pipes, the
round loop, per-token versions), measured in the same run (target >= 0.95).

Both decode exactly ``--new-tokens`` tokens for each of ``--prompts`` GSM8K questions (chat
template, EOS ignored so the work is identical) with SmolLM2-135M-Instruct. The generator is
timed after start-up (a one-off cost per job) and a warm-up request; transformers runs batched
generation (left padding, KV cache, ``--hf-batch`` rows at a time, bf16 and fp32 timed, its faster
dtype counted) in this process on all cores. Runs alternate (generator, transformers, ...) for
``--repeats`` rounds so machine noise hits both alike; the ratio of generated tokens/s at each
side's fastest repeat is the headline (target >= 3), the median-based ratio is printed beside it.
Writes a JSON and, when matplotlib is installed, a PNG.

    megarl bench generator [--prompts 32] [--new-tokens 128] [--repeats 2] \\
        [--quantization none] [--hf-batch 32] [--compile] [--out runs/bench]

``--quick`` is a smoke run (2 prompts x 8 tokens, 1 repeat, transformers fp32 only, the built-in
arithmetic prompts) that checks the bench end to end, e.g. with ``--model <tiny HF folder>``; its
ratio means little (engine overheads dominate).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from megarl.utils.paths import portable_path


QUICK = dict(prompts=2, new_tokens=8, repeats=1, hf_batch=2, hf_dtypes="float32", data="builtin:arithmetic")


def _prompts(tokenizer, n: int, data: str) -> list[list[int]]:
    from megarl.data.tasks import format_prompt, load_tasks

    tasks = load_tasks(data, limit=n)
    return [tokenizer(format_prompt(t, tokenizer), add_special_tokens=False)["input_ids"] for t in tasks]


def _hf_run(model, prompts: list[list[int]], new_tokens: int, batch: int, pad_id: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch):
        rows = prompts[i:i + batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, top_k=None, top_p=None,
                                 temperature=None, pad_token_id=pad_id)
        tokens += (out.shape[1] - width) * len(rows)
    return time.perf_counter() - t0, tokens


def _raw_vllm_worker(conn, cfg, model_dir: str, threads_bind: str | None) -> None:
    """Raw vLLM: ``LLM.generate`` with the replica's engine arguments; answers ("run", prompts,
    new_tokens) with (seconds, tokens) until it gets ("exit",)."""
    import dataclasses

    from megarl.generator.engine import engine_args, replica_env
    from megarl.utils.procs import watch_parent

    watch_parent(os.getppid())
    os.environ.update(replica_env(cfg, threads_bind, on_cpu=not torch.cuda.is_available()))
    from vllm import LLM, EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt

    args = engine_args(cfg, model_dir, 0, on_cpu=not torch.cuda.is_available())
    defaults = EngineArgs(model=args.model)
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
              if f.name != "worker_extension_cls" and getattr(args, f.name) != getattr(defaults, f.name)}
    llm = LLM(model=args.model, **kwargs)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            return
        _, prompts, new_tokens = msg
        params = SamplingParams(n=1, temperature=0.0, max_tokens=new_tokens, logprobs=0, detokenize=False,
                                ignore_eos=True)  # what the replica asks for (engine.py sampling_params)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        secs = time.perf_counter() - t0
        conn.send((secs, sum(len(o.outputs[0].token_ids) for o in outs)))


class _RawVllm:
    """The raw-vLLM process, started and stopped like an engine (no orphan on any exit)."""

    def __init__(self, cfg, model_dir: str, threads_bind: str | None):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_raw_vllm_worker, args=(child, cfg, model_dir, threads_bind), daemon=True)
        self.proc.start()
        child.close()
        self._await(600, "start")

    def _await(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        print(f"waiting up to {timeout:.0f}s for raw vLLM to {what}", flush=True)
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"raw vLLM (pid {self.proc.pid}) exited with code {self.proc.exitcode} "
                                   f"before it could {what}; its traceback is above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw vLLM did not {what} within {timeout:.0f}s")
        return self.conn.recv()

    def run(self, prompts, new_tokens: int) -> tuple[float, int]:
        self.conn.send(("run", prompts, new_tokens))
        return self._await(1800, "finish a repeat")

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(prog="megarl bench generator", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:smollm2", help="HF folder or builtin:smollm2")
    gsm8k = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"  # ../shared beside the checkout
    p.add_argument("--data", default=str(gsm8k) if gsm8k.exists() else "builtin:arithmetic",
                   help="prompts: a data file (default: GSM8K's train split in ../shared when there, else "
                        "builtin:arithmetic)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quantization", default="none")
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--hf-dtypes", default="bfloat16,float32")
    p.add_argument("--threads-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND of the engine, e.g. 0 or 0-1 "
                   "(the cores a calibration constant is measured on)")
    p.add_argument("--max-model-len", type=int, default=0, help="engine max_model_len (tokens; 0 = longest prompt + "
                   "--new-tokens + 8). Calibration uses the run's own (2048, generator.max_model_len): measured "
                   "with 64 x 24 tokens, 27 tok/s at 80 against the step bench's ~180")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype (generator.dtype; the quickstart runs float32)")
    p.add_argument("--compile", action="store_true", help="let vLLM torch.compile (enforce_eager=False)")
    p.add_argument("--no-raw", action="store_true", help="skip raw vLLM (LLM.generate) beside the executor")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--quick", action="store_true", help="smoke run: "
                   f"{', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in QUICK.items())}; "
                   "explicit flags still win")
    if "--quick" in __import__("sys").argv[1:]:
        p.set_defaults(**QUICK)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.generator.config import GeneratorConfig
    from megarl.generator.executor import GeneratorExecutor

    model_dir = a.model
    if model_dir == "builtin:smollm2":
        from megarl.models.smollm2 import ensure_smollm2_hf
        model_dir = str(ensure_smollm2_hf())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tok, a.prompts, a.data)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tok.padding_side = "left"

    cfg = GeneratorConfig(tp=1, replicas=1, quantization=a.quantization, temperature=0.0, n_samples=1, dtype=a.dtype,
                          max_new_tokens=a.new_tokens, max_model_len=a.max_model_len or max(map(len, prompts)) + a.new_tokens + 8,
                          kv_cache_gib=2, threads_bind=a.threads_bind, max_num_seqs=max(a.prompts, 8),
                          enforce_eager=not a.compile)
    torch.set_num_threads(os.cpu_count() or 1)
    hf_models = {d: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, d)).eval()
                 for d in a.hf_dtypes.split(",") if d and d != "none"}  # none: the generator alone
    gen_runs, raw_runs, hf_runs = [], [], {d: [] for d in hf_models}
    t_start = time.perf_counter()
    ex = GeneratorExecutor(cfg, model_dir).start()
    start_s = time.perf_counter() - t_start
    sampling = {"temperature": 0.0, "ignore_eos": True}
    raw = None
    try:
        ex.generate(prompts[:2], max_new_tokens=8, sampling=sampling)  # warm-up
        if not a.no_raw:
            from megarl.generator.executor import threads_binds

            raw = _RawVllm(cfg, model_dir, threads_binds(cfg)[0] if not torch.cuda.is_available() else None)
            raw.run(prompts[:2], 8)  # warm-up
        for r in range(a.repeats):
            if raw is not None:  # the executor's engine idles (blocked on its pipe) meanwhile
                secs, toks = raw.run(prompts, a.new_tokens)
                raw_runs.append(toks / secs)
                print(f"repeat {r}: raw vLLM {toks} tokens in {secs:.2f}s = {toks / secs:.1f} tok/s", flush=True)
            t0 = time.perf_counter()
            samples = ex.generate(prompts, max_new_tokens=a.new_tokens, sampling=sampling)
            secs = time.perf_counter() - t0
            toks = sum(len(s.completion_ids) for s in samples)
            gen_runs.append(toks / secs)
            print(f"repeat {r}: generator {toks} tokens in {secs:.2f}s = {toks / secs:.1f} tok/s", flush=True)
            # The engine idles (blocked on its pipe) while transformers runs.
            for d, m in hf_models.items():
                if r == 0:
                    _hf_run(m, prompts[:2], 4, a.hf_batch, pad_id)  # warm-up
                secs, toks = _hf_run(m, prompts, a.new_tokens, a.hf_batch, pad_id)
                hf_runs[d].append(toks / secs)
                print(f"repeat {r}: transformers[{d}] {toks} tokens in {secs:.2f}s = {toks / secs:.1f} tok/s",
                      flush=True)
    finally:
        if raw is not None:
            raw.close()
        ex.shutdown()

    if not hf_runs:  # --hf-dtypes none --no-raw: a calibration constant (tok/s on --threads-bind cores)
        result = {"model": portable_path(model_dir), "prompts": a.prompts, "new_tokens": a.new_tokens, "repeats": a.repeats,
                  "dtype": a.dtype, "threads_bind": a.threads_bind, "max_model_len": cfg.max_model_len,
                  "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                  "generator_start_s": round(start_s, 1), "generator_tok_s": gen_runs, "raw_vllm_tok_s": raw_runs}
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_generator.json").write_text(json.dumps(result, indent=2))
        print(f"generator {statistics.median(gen_runs):.1f} tok/s median ({a.prompts} x {a.new_tokens}, "
              f"threads_bind {a.threads_bind}); wrote {out / 'bench_generator.json'}", flush=True)
        return
    best_hf_dtype = max(hf_runs, key=lambda d: max(hf_runs[d]))
    ratio_best = max(gen_runs) / max(hf_runs[best_hf_dtype])
    ratio_median = statistics.median(gen_runs) / statistics.median(hf_runs[best_hf_dtype])
    result = {
        "model": portable_path(model_dir), "prompts": a.prompts, "new_tokens": a.new_tokens, "repeats": a.repeats,
        "dtype": a.dtype, "threads_bind": a.threads_bind,
        "quantization": a.quantization, "compile": a.compile, "cpus": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "generator_start_s": round(start_s, 1),
        "generator_tok_s": gen_runs, "transformers_tok_s": hf_runs, "transformers_dtype": best_hf_dtype,
        "ratio_best": round(ratio_best, 2), "ratio_median": round(ratio_median, 2), "target": 3.0,
        "raw_vllm_tok_s": raw_runs,
    }
    if raw_runs:
        result["executor_over_raw_best"] = round(max(gen_runs) / max(raw_runs), 3)
        result["executor_over_raw_median"] = round(statistics.median(gen_runs) / statistics.median(raw_runs), 3)
        print(f"generator executor {max(gen_runs):.1f} tok/s vs raw vLLM LLM.generate {max(raw_runs):.1f} tok/s: "
              f"{result['executor_over_raw_best']:.3f}x (median-based {result['executor_over_raw_median']:.3f}x; "
              f"target >= 0.95)", flush=True)
    print(f"generator {max(gen_runs):.1f} tok/s vs transformers[{best_hf_dtype}] "
          f"{max(hf_runs[best_hf_dtype]):.1f} tok/s: ratio {ratio_best:.2f}x (median-based "
          f"{ratio_median:.2f}x; target >= 3x); engine start-up {start_s:.1f}s", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_generator.json").write_text(json.dumps(result, indent=2))
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the generator bench")
    if plt is None:
        return
    labels = ["generator executor"] + (["raw vLLM"] if raw_runs else []) + [f"transformers {d}" for d in hf_runs]
    values = [max(gen_runs)] + ([max(raw_runs)] if raw_runs else []) + [max(v) for v in hf_runs.values()]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, values, color=["tab:blue"] + (["tab:orange"] if raw_runs else []) + ["tab:gray"] * len(hf_runs))
    ax.set_ylabel("generated tokens / s (best repeat)")
    ax.set_title(f"{Path(model_dir).name}: {a.prompts} prompts x {a.new_tokens} tokens, "
                 f"{ratio_best:.1f}x", fontsize=9)
    save(fig, out / "bench_generator.png", dpi=120)
    print(f"wrote {out / 'bench_generator.json'} and {out / 'bench_generator.png'}")


if __name__ == "__main__":
    import sys

    from megarl.utils.errors import run_main
    from megarl.utils.procs import JobInterrupted, signals_raise

    # A timeout's SIGTERM (or Ctrl-C, SIGHUP) unwinds main(): its finally shuts the engine down;
    # the replica also watches this process, so even a SIGKILL leaves no engine behind.
    try:
        with signals_raise():
            code = run_main(main, "megarl bench generator")  # a failure: one line, the exit code of its class
    except JobInterrupted as exc:
        print(f"bench_generator: {exc}; engine stopped", file=sys.stderr)
        sys.exit(exc.exit_code)
    sys.exit(code)
