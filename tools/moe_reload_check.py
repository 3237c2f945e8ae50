"""Does vLLM's layerwise reload of an MoE checkpoint reproduce its own load? (docs/moe.md)

Loads an HF folder in an in-process fp32 vLLM engine, takes the prompt logprobs of 12 fixed random
tokens, reloads the folder's own tensors whose names contain ``--only`` through
``reload_weights(is_checkpoint_format=True)`` (the path megarl's weight updates take), and prints the
largest logprob change (0 when the reload is right: the weights are the same) and the largest
difference of the first load from transformers. Writes JSON with ``--json``.

    .venv/bin/python tools/moe_reload_check.py --hf /path/to/tiny_qwen3_moe --only mlp.experts
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="HF model folder (model.safetensors)")
    ap.add_argument("--only", default="", help="reload only tensors whose name contains this (default: all)")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    toks = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(model=args.hf, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, gpu_memory_utilization=0.5)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def logprobs() -> list[float]:
        out = llm.generate({"prompt_token_ids": toks}, sp)
        return [next(iter(x.values())).logprob for x in out[0].prompt_logprobs[1:]]

    first = logprobs()
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()(torch.tensor([toks])).logits[0]
    hf = torch.log_softmax(logits.double(), -1)[:-1].gather(-1, torch.tensor(toks[1:])[:, None]).squeeze(-1).tolist()
    items = [(k, v) for k, v in load_file(os.path.join(args.hf, "model.safetensors")).items() if args.only in k]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
    llm.reset_prefix_cache()
    again = logprobs()
    res = {"hf": args.hf, "only": args.only, "tensors_reloaded": len(items),
           "load_vs_transformers_max_abs": max(abs(a - b) for a, b in zip(first, hf)),
           "reload_vs_load_max_abs": max(abs(a - b) for a, b in zip(first, again))}
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
