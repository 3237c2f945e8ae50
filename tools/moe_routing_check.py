"""Routing mismatch: how often do vLLM's engine and the reference route a token to different experts?
(docs/moe.md, "Routing mismatch")

Loads an HF MoE folder in an in-process vLLM engine (``--dtype``) and in transformers (fp32: the
reference the Megatron trainer matches within ~1e-6 nats, tests/e2e/test_moe.py), runs the same random
prompts through both, and compares, token by token and MoE layer by MoE layer, the set of top-k
experts each router picks (engine: a forward hook on every ``mlp.gate``; transformers: its router
logits). The engine's weights after a DDMA sync are bit for bit those of a fresh load
(tests/e2e/test_ddma_landing.py), so a fresh load stands for a synced engine. Also prints the smallest
gap between the k-th and (k+1)-th router logit (how close a token came to another expert). JSON
with ``--json``.

    .venv/bin/python tools/moe_routing_check.py --hf /path/to/tiny_qwen3_moe [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os


def _capture(self) -> int:
    """Worker side: hook every router (``mlp.gate``) to keep its logits of each forward."""
    store = self.__dict__.setdefault("_routing", {})
    n = 0
    for name, mod in self.model_runner.model.named_modules():
        if name.endswith(".mlp.gate"):
            def hook(_m, _inp, out, _name=name):
                logits = out[0] if isinstance(out, tuple) else out
                store.setdefault(_name, []).append(logits.detach().float().cpu().clone())
            mod.register_forward_hook(hook)
            n += 1
    return n


def _collect(self) -> dict:
    store = self.__dict__.get("_routing", {})  # the hooks hold this dict: empty it, keep it
    out = {k: list(v) for k, v in store.items()}
    store.clear()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="HF MoE model folder (Qwen3-MoE)")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (default float32)")
    ap.add_argument("--prompts", type=int, default=8, help="random prompts (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per prompt (default 64)")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    cfg = AutoConfig.from_pretrained(args.hf)
    k = int(cfg.num_experts_per_tok)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.tokens,), generator=g).tolist() for _ in range(args.prompts)]
    llm = LLM(model=args.hf, dtype=args.dtype, enforce_eager=True, max_model_len=max(256, args.tokens + 8), seed=0,
              enable_prefix_caching=False)
    assert llm.collective_rpc(_capture)[0] > 0, "no mlp.gate router in the engine"
    engine = []
    for p in prompts:  # one prompt per call: each prefill's router logits are that prompt's tokens
        llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=1), use_tqdm=False)
        got = llm.collective_rpc(_collect)[0]
        engine.append({name: chunks[0][:len(p)] for name, chunks in got.items()})  # the prefill forward
    ref = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    layers = sorted(engine[0], key=lambda n: int(n.split(".")[2]))
    differ = total = 0
    min_gap = float("inf")
    with torch.no_grad():
        for p, eng in zip(prompts, engine):
            out = ref(torch.tensor([p]), output_router_logits=True)
            for name, hf_logits in zip(layers, out.router_logits):
                hf_logits = hf_logits.reshape(len(p), -1).float()
                top_hf = hf_logits.topk(k, -1).indices.sort(-1).values
                top_eng = eng[name].topk(k, -1).indices.sort(-1).values
                differ += int((top_hf != top_eng).any(-1).sum())
                total += len(p)
                srt = hf_logits.sort(-1, descending=True).values
                if srt.shape[-1] > k:
                    min_gap = min(min_gap, float((srt[:, k - 1] - srt[:, k]).min()))
    res = {"hf": args.hf, "engine_dtype": args.dtype, "moe_layers": len(layers), "top_k": k,
           "token_layer_pairs": total, "routed_differently": differ, "fraction": differ / max(1, total),
           "min_topk_logit_gap": min_gap}
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
