"""Strict held-out accuracy of an HF model folder with transformers (greedy), outside megarl's engines.

Checks an exported policy the way a user would after `megarl convert mcore-to-hf`: the run's own
held-out prompts (rebuilt from its config, exactly as `megarl train` held them out), or fresh
arithmetic problems from another seed, kept only if their question is not among the run's
training prompts (by content). Scored by the same strict scorer as `eval/accuracy` (the last number
of a reply that finished; nothing evaluated).

    .venv/bin/python tools/eval_hf.py --hf runs/quickstart/hf --config runs/quickstart/config.yaml
    .venv/bin/python tools/eval_hf.py --hf runs/quickstart/hf --config runs/quickstart/config.yaml \\
        --fresh 200 --seed 98765
--out FILE writes a JSON report (accuracy, format rate, truncated fraction, a few replies).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def held_out(cfg, hf_dir: Path, fresh: int, seed: int):
    from megarl.controller.prompts import PromptSource, question_key
    from megarl.data import format_prompt
    from megarl.data.tasks import arithmetic_tasks

    source = PromptSource(cfg, hf_dir)
    if not fresh:
        return source.eval_set()
    seen = {question_key(t.question) for t, _ in source.train} | {question_key(t.question) for t, _ in source.held}
    tasks = [t for t in arithmetic_tasks(20000, seed=seed) if question_key(t.question) not in seen][:fresh]
    ids = [source.tokenizer.encode(format_prompt(t, source.tokenizer, chat_template=cfg.data.chat_template),
                                   add_special_tokens=False) for t in tasks]
    return tasks, ids


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch: int = 32):
    """(reply text, finish reason, completion length) per prompt; left-padded batches."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             top_k=None, top_p=None, temperature=None, pad_token_id=pad, eos_token_id=eos)
        for row in gen[:, width:].tolist():
            n = row.index(eos) + 1 if eos in row else len(row)
            finished = eos in row
            out.append((tokenizer.decode(row[:n], skip_special_tokens=True), "stop" if finished else "length", n))
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.config import load_config
    from megarl.controller.evaluation import score_replies

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, type=Path, help="HF model folder (e.g. from megarl convert mcore-to-hf)")
    ap.add_argument("--config", required=True, help="the run's config.yaml (its data and reply budget)")
    ap.add_argument("--fresh", type=int, default=0, help="N fresh arithmetic problems instead of the run's held-out set")
    ap.add_argument("--seed", type=int, default=98765, help="seed of the fresh problems")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here (default: print only)")
    args = ap.parse_args()
    cfg = load_config(args.config, [f"model.path={args.hf}"])
    tasks, prompts = held_out(cfg, args.hf, args.fresh, args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.hf)
    t0 = time.monotonic()
    replies = greedy(model, tokenizer, prompts, cfg.generator.max_new_tokens)
    result, correct = score_replies([r for r, _, _ in replies], [t.answer for t in tasks],
                                    [f for _, f, _ in replies], [n for _, _, n in replies])
    report = {**result.metrics(), "seconds": time.monotonic() - t0, "source": "fresh" if args.fresh else "run held-out",
              "examples": [{"question": t.question, "gold": t.answer, "reply": r, "correct": c}
                           for t, (r, _, _), c in list(zip(tasks, replies, correct))[:8]]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(f"{args.hf}: strict greedy accuracy {result.accuracy:.3f} on {result.n} {report['source']} prompts | "
          f"format {result.format_rate:.3f} | truncated {result.truncated_frac:.3f}")


if __name__ == "__main__":
    main()
