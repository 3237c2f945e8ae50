"""Generator section of the config: the vLLM engines that produce rollouts.

Logprob convention (the trainer must match it): with ``logprobs_mode='processed'`` (default) a
sample's ``behav_logprobs`` are ``log_softmax(logits / temperature)`` of the sampled tokens, i.e.
the distribution the token was actually drawn from (greedy, temperature 0, reports the untempered
``log_softmax(logits)``). The trainer reproduces it by dividing its logits by
:meth:`GeneratorConfig.trainer_logprob_temperature`. With ``top_p < 1`` or ``top_k > 0`` vLLM's
processed logprobs are renormalised over the kept tokens, which no trainer-side temperature
reproduces; ``'raw'`` reports the untempered model distribution (trainer temperature 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.utils.knobs import knob

QUANTIZATIONS = ("none", "fp8_per_channel", "fp8_per_tensor", "fp8_per_block")
# FP8 schemes vLLM runs on CPU; the others need a GPU.
CPU_QUANTIZATIONS = ("none", "fp8_per_channel")
DTYPES = ("bfloat16", "float16", "float32")
LOGPROBS_MODES = ("processed", "raw")


@dataclass
class GeneratorConfig:
    # --- parallelism and precision ---
    tp: int = knob(1, help="Tensor-parallel size of each vLLM engine (ranks); must divide the "
                   "model's attention heads. Default 1.")
    replicas: int = knob(1, help="Data-parallel engine replicas, each its own process with its own TP "
                         "(engines). Default 1.")
    dtype: str = knob("bfloat16", choices=DTYPES, help="Activation/weight dtype of the engines; "
                      "pushed weights are cast to it. Default bfloat16.")
    quantization: str = knob("none", choices=QUANTIZATIONS, help="Weight quantization, re-applied "
                             "on every weight update: 'fp8_per_channel' (CPU and GPU), "
                             "'fp8_per_tensor'/'fp8_per_block' (GPU only). Default none.")
    kv_cache_gib: int = knob(2, help="KV-cache memory per engine (GiB, integer; on CPU sets "
                             "VLLM_CPU_KVCACHE_SPACE). Default 2.")
    gpu_memory_utilization: float = knob(0.0, help="GPU only: fraction of device memory per engine, in "
                                         "(0, 1]; 0 = size the KV cache from kv_cache_gib instead. Default 0.")
    max_model_len: int = knob(2048, help="Longest prompt + completion an engine accepts (tokens). "
                              "Default 2048.")
    max_turns: int = knob(1, help="Most replies of one multi-turn rollout (an environment that answers with "
                          "observation tokens, megarl/controller/turns.py); a rollout still going then ends as "
                          "truncated (replies). Default 1 = single turn.")
    max_num_seqs: int = knob(256, help="Most sequences an engine decodes at once (sequences). "
                             "Default 256.")
    enforce_eager: bool = knob(True, help="Skip torch.compile in the engines (faster start-up, "
                               "and on small CPU models no slower). Default true.")

    # --- sampling ---
    max_new_tokens: int = knob(256, help="Longest completion per sample (tokens). Default 256.")
    temperature: float = knob(1.0, help="Sampling temperature (dimensionless, >= 0); 0 = greedy. Default 1.0.")
    top_p: float = knob(1.0, help="Nucleus sampling mass (fraction, in (0, 1]); 1 = off. Default 1.0.")
    top_k: int = knob(-1, help="Sample from the k most likely tokens; -1 = off. Default -1.")
    n_samples: int = knob(4, help="Samples per prompt (a GRPO group; samples). Default 4.")
    stop: list[str] = knob(default_factory=list, help="Strings that end a completion (kept in the "
                           "token ids). Default [] (none).")
    logprobs_mode: str = knob("processed", choices=LOGPROBS_MODES, help="Which distribution "
                              "behav_logprobs come from: 'processed' = the tempered one tokens are "
                              "sampled from (trainer divides logits by the temperature), 'raw' = the "
                              "untempered model (trainer temperature 1). Default processed.")
    seed: int = knob(0, help="Engine sampling seed (replica r uses seed + r); with "
                     "controller.deterministic, every request's seed derives from it and the sample's id "
                     "instead (per-request seeds work on CPU only without chunked prefill, which that mode "
                     "turns off). Default 0.")

    # --- async / partial rollouts ---
    round_token_budget: int = knob(0, help="Partial rollouts: a generation is cut after this many new "
                                   "tokens per round, cached, and resumed (prefix kept) after the next "
                                   "weight update (tokens); 0 = off. Default 0.")

    # --- process and lifecycle ---
    threads_bind: str = knob("auto", help="CPU only: VLLM_CPU_OMP_THREADS_BIND per replica, e.g. "
                             "'0-1' (TP=1) or '0|1' (TP=2); several replicas separated by ';'. "
                             "'auto' splits this process's cores evenly over replicas and TP ranks. "
                             "Every core named must be one this process may run on. Default auto.")
    start_timeout_s: float = knob(600.0, help="Longest an engine may take to start, counted from "
                                  "its launch (the trainer starts alongside) (seconds, > 0). Default 600.")
    request_timeout_s: float = knob(600.0, help="Longest a wait for generation may go without any "
                                    "engine finishing a sample (seconds, > 0). Default 600.")
    update_timeout_s: float = knob(600.0, help="Longest a weight update may take on every engine "
                                   "(seconds, > 0). Default 600.")
    shutdown_timeout_s: float = knob(30.0, help="Grace period for an engine to exit before it is "
                                     "killed (seconds, > 0). Default 30.")
    heartbeat_timeout_s: float = knob(120.0, help="Supervision: a replica that holds work and sends nothing "
                                      "(a replica reports every 5 s while decoding, and each finished request) "
                                      "for this long is taken as frozen, killed and restarted (attached under "
                                      "Slurm: the job stops, naming it) (seconds; must exceed 5 and the longest "
                                      "single engine step or weight load). Default 120.")
    max_restarts: int = knob(3, help="Supervision: restarts of one replica allowed within restart_window_s; the "
                             "failure after them stops the job, naming the replica and its causes (restarts). "
                             "0 = never restart: any replica failure stops the job. Default 3.")
    restart_window_s: float = knob(3600.0, help="Supervision: the window max_restarts counts over (seconds). "
                                   "Default 3600.")
    log_dir: str = knob("", help="Folder for the engines' logs (one file per replica); '' = the run's logs "
                        "folder under megarl train (beside the trainer ranks'), a temporary folder for an "
                        "executor started alone; the validator checks it can be created and written. Default ''.")

    def trainer_logprob_temperature(self) -> float:
        """The temperature the trainer must divide logits by to reproduce ``behav_logprobs``."""
        if self.logprobs_mode == "raw" or self.temperature <= 0:
            return 1.0
        return float(self.temperature)

    def problems(self, on_cpu: bool) -> list[str]:
        """Section-local problems, each naming the key and what to change."""
        out = []
        for key in ("tp", "replicas", "kv_cache_gib", "max_model_len", "max_num_seqs",
                    "max_new_tokens", "n_samples", "max_turns"):
            if getattr(self, key) < 1:
                out.append(f"generator.{key}={getattr(self, key)}: must be >= 1")
        if self.quantization not in QUANTIZATIONS:
            out.append(f"generator.quantization={self.quantization!r}: choose one of {QUANTIZATIONS}")
        elif on_cpu and self.quantization not in CPU_QUANTIZATIONS:
            out.append(f"generator.quantization={self.quantization!r} runs only on GPUs; on CPU use one "
                       f"of {CPU_QUANTIZATIONS}")
        if self.quantization != "none" and self.dtype == "float32":
            # vLLM's FP8 methods run bf16 / fp16 activations only (its config check raises at engine start)
            out.append(f"generator.quantization={self.quantization!r} needs generator.dtype=bfloat16 or float16 "
                       f"(FP8 weights with half-precision activations), not float32")
        if self.temperature < 0:
            out.append(f"generator.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            out.append(f"generator.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            out.append(f"generator.top_k={self.top_k}: use -1 (off) or a positive count")
        if self.round_token_budget < 0:
            out.append(f"generator.round_token_budget={self.round_token_budget}: must be >= 0 (0 = off)")
        if on_cpu and self.threads_bind != "auto":  # the shape megarl.generator.threads.threads_binds reads
            parts = self.threads_bind.split(";")
            if len(parts) not in (1, self.replicas):
                out.append(f"generator.threads_bind={self.threads_bind!r} names {len(parts)} replicas; give one "
                           f"binding or generator.replicas={self.replicas} separated by ';'")
            elif any(len(p.split("|")) != self.tp for p in parts):
                out.append(f"generator.threads_bind={self.threads_bind!r}: each replica's binding needs "
                           f"generator.tp={self.tp} core lists separated by '|' (e.g. "
                           f"{'|'.join(['0'] * self.tp)!r}), or 'auto'")
            else:  # every core named must be one this process may run on (as cluster.trainer_cpus)
                from megarl.utils.procs import cpu_list_problem

                lists = [c for p in parts for c in p.split("|") if c.strip() not in ("auto", "nobind")]
                problem = cpu_list_problem(",".join(lists), f"generator.threads_bind={self.threads_bind!r}")
                if problem:
                    out.append(problem)
        for key in ("start_timeout_s", "request_timeout_s", "update_timeout_s", "shutdown_timeout_s"):
            if getattr(self, key) <= 0:
                out.append(f"generator.{key}={getattr(self, key)}: must be > 0 (seconds)")
        if not 0 <= self.gpu_memory_utilization <= 1:
            out.append(f"generator.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1] (a "
                       f"fraction of one GPU's memory), or 0 to size the KV cache from generator.kv_cache_gib")
        if self.heartbeat_timeout_s <= 5.0:  # engine.HEARTBEAT_S: a decoding replica reports this often
            out.append(f"generator.heartbeat_timeout_s={self.heartbeat_timeout_s}: must exceed 5 s, the interval "
                       f"at which a decoding replica reports progress (else every busy replica looks frozen)")
        if self.max_restarts < 0:
            out.append(f"generator.max_restarts={self.max_restarts}: must be >= 0 (0 = a failed replica stops the job)")
        if self.restart_window_s <= 0:
            out.append(f"generator.restart_window_s={self.restart_window_s}: must be > 0 (seconds)")
        if self.max_new_tokens >= self.max_model_len:
            out.append(f"generator.max_new_tokens={self.max_new_tokens} leaves no room for a prompt in "
                       f"generator.max_model_len={self.max_model_len}; raise max_model_len")
        return out
