"""Knobs of the trainer executor: parallelism, batch, optimizer, LR schedule, checkpoints.

The lead composes :class:`TrainerConfig` into the top-level config (``trainer:`` section).
Cross-section checks (ranks vs world size, TP vs the model's heads) live in
``megarl.config.validate``; :meth:`TrainerConfig.problems` covers what this section alone decides.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megarl.utils.knobs import knob

LR_DECAY_STYLES = ("constant", "linear", "cosine")
PARAMS_DTYPES = ("float32", "bfloat16")
RECOMPUTE_MODES = ("none", "selective", "full")
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megarl/trainer/lora.py


@dataclasses.dataclass
class TrainerConfig:
    # --- parallelism (ranks of the trainer executor = tp * pp * dp) ---
    tp: int = knob(1, help="Tensor-parallel size (ranks); must divide the model's attention and KV "
                   "heads. Default 1.")
    pp: int = knob(1, help="Pipeline-parallel size (ranks); must divide the model's layer count. "
                   "Default 1.")
    dp: int = knob(1, help="Data-parallel replicas of the tp x pp model (ranks = tp*pp*dp). Default 1.")
    ep: int = knob(1, help="Expert-parallel size of an MoE model (ranks): the routed experts split "
                   "evenly over ep of the dp replicas (megatron's expert_model_parallel_size); must "
                   "divide dp and the model's num_experts; 1 for dense models. Default 1.")
    moe_aux_loss_coeff: float = knob(0.0, help="Weight of the router's load-balancing (auxiliary) loss "
                                     "of an MoE model, added to the policy loss (dimensionless; megatron's "
                                     "moe_aux_loss_coeff with the 'aux_loss' balancing). 0 = off, as RL "
                                     "recipes run it: routing then follows the policy loss only. Default 0.")
    router_replay: bool = knob(False, help="Rollout routing replay (R3) for an MoE model (flag): every trainer "
                               "forward (logprob passes and training) routes each token to the top-k experts the "
                               "generator's engine routed it to (the sample's routed experts, per MoE layer; the "
                               "gate weights stay the trainer router's own scores at those experts, "
                               "differentiable); tokens the engine did not report keep the trainer's choice. "
                               "moe/routing_mismatch (share of token-layer pairs routed otherwise than the engine "
                               "did) is logged either way and is 0 with replay. Only for MoE models; any trainer "
                               "layout (pipeline stages take their layers' ids; a full recompute replays each "
                               "micro-batch's own). Default false.")

    # --- batch ---
    micro_batch_size: int = knob(4, help="Sequences per forward/backward micro-batch on one DP "
                                 "replica (sequences); a step's rollout batch is split over DP, "
                                 "then into micro-batches (gradient accumulation). Default 4.")

    packing: bool = knob(True, help="Pack a micro-batch's sequences without padding, for the logprob passes and "
                         "training; each sequence attends only to itself and keeps position_ids 0..len-1. Local "
                         "(CPU) layer spec: first-fit decreasing into rows no longer than the micro-batch's longest "
                         "sequence, block-diagonal causal mask (megatron's rope rotates by row offset, which "
                         "cancels in q.k); transformer-engine spec: one THD row with cu_seqlens. Exact: the same "
                         "logprobs and gradients as padded rows up to float summation order. false = right-padded "
                         "rows. Default true.")
    max_tokens_per_micro_batch: int = knob(0, help="Token budget of one micro-batch (tokens, >= 0): micro-batches "
                                           "are formed by length so each holds at most this many real tokens (a "
                                           "longer sequence goes alone), DP ranks get balanced token counts, "
                                           "and pipeline stages agree on the micro-batch count. 0 = count "
                                           "sequences (trainer.micro_batch_size). Default 0.")
    recompute: str = knob("none", choices=RECOMPUTE_MODES,
                          help="Activation recompute (megatron-core's recompute_granularity): none; selective "
                          "(recompute the core attention, whose [b, heads, s, s] scores are the largest "
                          "activation); full (every transformer layer, keeping only its input). Trades a forward "
                          "pass's compute for memory. Default none.")

    minibatches: int = knob(1, help="Optimizer updates per pass over a step's rollout batch (count, >= 1): the "
                            "batch is split along prompt groups (a group is never split) into this many "
                            "minibatches of about equal groups, each one optimizer update (PPO's minibatches; "
                            "A-3PO's recipes use 4, VACO's forward lag N). Behaviour logprobs stay the "
                            "generator's; the proximal policy (decoupled_ppo, tis) is computed once before the "
                            "first update and frozen for the step. controller.prompts_per_step must divide by it. "
                            "Default 1.")
    epochs: int = knob(1, help="Passes over a step's rollout batch (count, >= 1); a step makes minibatches x "
                       "epochs optimizer updates (train/updates), in the same minibatch order each pass. The "
                       "policy version still advances once per step. Default 1.")

    # --- optimizer (AdamW) ---
    lr: float = knob(1.0e-6, help="Peak learning rate (per step, AdamW). Default 1e-6.")
    min_lr: float = knob(0.0, help="Floor of the decayed learning rate (as lr, in [0, lr]; linear/cosine). Default 0.")
    lr_warmup_steps: int = knob(0, help="Linear warmup over this many optimizer updates (updates: a step "
                                "makes trainer.minibatches x trainer.epochs of them): megatron's schedule "
                                "gives update u the lr*u/lr_warmup_steps, so the first update runs at lr 0. "
                                "Default 0.")
    lr_decay_steps: int = knob(0, help="Optimizer updates over which lr decays to min_lr after warmup "
                               "(updates, as lr_warmup_steps); 0 = every update of the run (controller.steps x "
                               "minibatches x epochs). Default 0.")
    lr_decay_style: str = knob("constant", choices=LR_DECAY_STYLES,
                               help="LR schedule after warmup: constant, linear or cosine. Default "
                               "constant.")
    weight_decay: float = knob(0.0, help="Decoupled (AdamW) weight decay; not applied to norms and "
                               "biases (dimensionless). Default 0.")
    adam_beta1: float = knob(0.9, help="AdamW first-moment decay (dimensionless). Default 0.9.")
    adam_beta2: float = knob(0.999, help="AdamW second-moment decay (dimensionless). Default 0.999.")
    adam_eps: float = knob(1.0e-8, help="AdamW denominator epsilon (dimensionless). Default 1e-8.")
    grad_clip: float = knob(1.0, help="Clip the global gradient L2 norm to this value (gradient norm, "
                            ">= 0); 0 = off. Default 1.0.")
    use_distributed_optimizer: bool = knob(True, help="Shard optimizer state and fp32 master "
                                           "weights across DP ranks (megatron "
                                           "DistributedOptimizer, ZeRO-1). Default true.")
    params_dtype: str = knob("float32", choices=PARAMS_DTYPES,
                             help="Model weight dtype; bfloat16 keeps fp32 master weights in the "
                             "optimizer. Default float32 (CPU); use bfloat16 on GPUs.")
    seed: int = knob(1234, help="Trainer seed: weight init where random, dropout RNG trackers. "
                     "Default 1234.")

    # --- LoRA (megarl/trainer/lora.py) ---
    lora_rank: int = knob(0, help="LoRA rank r (count, >= 0): adapters A [r, in], B [out, r] on the lora_targets "
                          "linears, every base weight frozen and the optimizer holding the adapters only; the "
                          "generator gets W + lora_alpha/r * B A at each sync. 0 = off (full fine-tuning). Default 0.")
    lora_alpha: float = knob(16.0, help="LoRA scale numerator: the update is lora_alpha / lora_rank * B A "
                             "(dimensionless, > 0; peft's lora_alpha). Used only when lora_rank > 0. Default 16.")
    lora_targets: list[str] = knob(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                                   help="Megatron linears that get adapters (names): linear_qkv (q/k/v), linear_proj "
                                   "(attention output), linear_fc1 (MLP gate+up), linear_fc2 (MLP down). Default all "
                                   "four: the attention and MLP projections.")

    max_skipped_steps: int = knob(3, help="An optimizer update whose loss or gradient is NaN/inf is skipped (no "
                                  "update, no LR-schedule step; a WARNING in the rank log, train/skipped = the "
                                  "step's skipped updates, train/skipped_steps the run's total); this many "
                                  "skipped in a row stop the job naming the cause (updates, >= 1). Default 3.")

    # --- logprobs ---
    logprob_temperature: float = knob(1.0, help="Temperature the trainer divides logits by before "
                                      "log-softmax; must equal the generator's convention: "
                                      "generator.temperature with logprobs_mode 'processed' (the "
                                      "default), 1.0 with 'raw' or greedy. The validator checks it "
                                      "(dimensionless, > 0). Default 1.0.")

    # --- checkpoints ---
    checkpoint_dir: str = knob("", help="Folder for trainer checkpoints ('' = <run dir>/checkpoints); the "
                               "validator checks it can be created and written. Default ''.")
    checkpoint_interval: int = knob(0, help="Save every N training steps (steps); 0 = only at the "
                                    "end of the run. Default 0.")
    async_save: bool = knob(False, help="Write checkpoints in the background: a save takes a snapshot "
                            "(a forked writer process holds it; on a GPU the tensors are copied to host "
                            "memory first) and the step goes on while the writer persists it; the next save "
                            "waits only if that write has not finished (and logs how long), a preemption "
                            "and the end of the run wait for it. The checkpoint counts (manifest, `latest`) "
                            "only once written; a write that does not end within trainer.save_timeout_s fails the job "
                            "loudly. Default false (docs/checkpoints.md).")
    keep_checkpoints: int = knob(2, help="Step folders kept on disk; older ones are deleted after a "
                                 "save succeeds. Keep >= 2 so a damaged newest checkpoint can fall back to "
                                 "the previous one at resume (count, >= 1). Default 2.")
    resume_from: Optional[str] = knob("auto", help="Checkpoint to resume from: 'auto' (the newest "
                                      "complete checkpoint under checkpoint_dir if there is one: rerunning "
                                      "the same command continues the run), a checkpoint_dir (its newest "
                                      "complete one), a step folder, or null = start over (`megarl train "
                                      "--fresh`; refused in a run folder that holds an earlier run unless "
                                      "logging.overwrite). Default 'auto'.")
    resume_optimizer: bool = knob(True, help="Resume the optimizer state (Adam moments, fp32 master "
                                  "weights, step counts) and the RNG states with the weights. false: the "
                                  "weights-only start: the checkpoint's weights, progress and LR schedule with a "
                                  "fresh optimizer (the moments start over). Default true.")

    # --- supervision of the rank processes (megarl.trainer.executor.TrainerExecutor) ---
    start_timeout_s: float = knob(300.0, help="Seconds every trainer rank may take to start: spawn, "
                                  "import, join the process group, build model + optimizer and "
                                  "resume, counted from the launch (the generator starts alongside) "
                                  "(s). Default 300.")
    step_timeout_s: float = knob(600.0, help="Seconds every trainer rank may take to answer one step "
                                 "command (the logprob passes and the optimizer step) before the job "
                                 "stops naming the silent rank (s). Default 600.")
    save_timeout_s: float = knob(600.0, help="Seconds every trainer rank may take to write (or "
                                 "load) a checkpoint, and to answer other commands (s). Default 600.")
    heartbeat_timeout_s: float = knob(60.0, help="A started trainer rank sends a heartbeat every "
                                      "second from a thread of its own (it keeps beating while it "
                                      "waits in a collective); one silent this long is frozen, and "
                                      "the job stops naming it, also while a command (a batch) waits "
                                      "for it to read its channel (s). Default 60.")
    shutdown_timeout_s: float = knob(30.0, help="Seconds trainer ranks get to exit after close() "
                                     "asks them; the rest are killed (s). Default 30.")

    def problems(self) -> list[str]:
        """Problems this section alone can see, each naming the key and what to change."""
        out = []
        for key in ("tp", "pp", "dp", "ep", "micro_batch_size", "minibatches", "epochs", "keep_checkpoints",
                    "max_skipped_steps"):
            if getattr(self, key) < 1:
                out.append(f"trainer.{key}={getattr(self, key)}: must be >= 1")
        for key in ("lr_warmup_steps", "lr_decay_steps", "checkpoint_interval", "max_tokens_per_micro_batch"):
            if getattr(self, key) < 0:
                out.append(f"trainer.{key}={getattr(self, key)}: must be >= 0")
        if self.moe_aux_loss_coeff < 0:
            out.append(f"trainer.moe_aux_loss_coeff={self.moe_aux_loss_coeff}: must be >= 0")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            out.append(f"trainer.lr={self.lr}, trainer.min_lr={self.min_lr}: need 0 <= min_lr <= lr "
                       f"and lr > 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            out.append(f"trainer.adam_beta1/2=({self.adam_beta1}, {self.adam_beta2}): each must be "
                       f"in [0, 1)")
        if self.adam_eps <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            out.append("trainer.adam_eps must be > 0, weight_decay and grad_clip >= 0")
        for key in ("start_timeout_s", "step_timeout_s", "save_timeout_s", "heartbeat_timeout_s",
                    "shutdown_timeout_s"):
            if getattr(self, key) <= 0:
                out.append(f"trainer.{key}={getattr(self, key)}: must be > 0 (seconds)")
        if self.recompute not in RECOMPUTE_MODES:
            out.append(f"trainer.recompute={self.recompute!r}: must be one of {', '.join(RECOMPUTE_MODES)}")
        if self.lora_rank < 0 or (self.lora_rank > 0 and self.lora_alpha <= 0):
            out.append(f"trainer.lora_rank={self.lora_rank}, trainer.lora_alpha={self.lora_alpha}: need lora_rank >= 0 "
                       f"(0 = off) and lora_alpha > 0")
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad or (self.lora_rank > 0 and not self.lora_targets):
            out.append(f"trainer.lora_targets={list(self.lora_targets)}: use a non-empty list of "
                       f"{', '.join(LORA_TARGETS)}")
        if self.logprob_temperature <= 0:
            out.append(f"trainer.logprob_temperature={self.logprob_temperature}: must be > 0")
        return out


def run_updates(cfg: TrainerConfig, steps: int) -> int:
    """Optimizer updates of a run of ``steps`` train steps (controller.steps): trainer.minibatches x
    trainer.epochs a step. What the LR schedule counts (megarl/trainer/local.py builds it over these)."""
    return steps * cfg.minibatches * cfg.epochs


def lr_decay_updates(cfg: TrainerConfig, updates: int) -> int:
    """The updates the LR decays over: trainer.lr_decay_steps, 0 = every update of the run (``updates``,
    :func:`run_updates`). megarl/trainer/optimizer.py build_scheduler and the validator both use it."""
    return cfg.lr_decay_steps or updates


def router_replay_problems(router_replay: bool, is_moe: bool, family: str = "") -> list[str]:
    """trainer.router_replay needs an MoE model (its routers are what is replayed); [] when fine."""
    if router_replay and not is_moe:
        return [f"trainer.router_replay=true but the model has no experts (model_type={family!r}): router "
                f"replay is for MoE models; set trainer.router_replay=false"]
    return []
