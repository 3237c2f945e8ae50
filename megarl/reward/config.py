"""Knobs of the reward: which reward function, its scores, truncation and overlong shaping.

The top-level config composes :class:`RewardConfig` as ``reward``; the controller builds
``RewardPool(cfg.reward, max_new_tokens=cfg.generator.max_new_tokens)``. Nothing here imports torch
or math-verify: validating a config stays fast. See docs/rewards.md.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from typing import List, Optional

from megarl.utils.knobs import knob

AUTO = "auto"              # reward.fn: follow the data (megarl/config/data_choice.py resolves it)
AUTO_FALLBACK = "arithmetic"  # what 'auto' means for a RewardConfig no loader resolved (the default data's)
# reward.env_step_timeout_s's default (s): far above a sandbox run (sandbox.WALL_TIMEOUT_S, 4 s) or a
# slow remote tool, so only an environment that does not bound itself meets it.
ENV_STEP_TIMEOUT_S = 300.0

@dataclasses.dataclass
class RewardConfig:
    fn: str = knob(AUTO, help="reward function: 'auto' (the training data's schema names it: arithmetic for "
                   "builtin arithmetic and plain rows, gsm8k for GSM8K, math for MATH, dapo for verl / DAPO rows; "
                   "the loader writes the choice into data.choice; a RewardConfig built without a config is "
                   "arithmetic), a built-in name (arithmetic: the reply's last number; gsm8k: the '####' answer, "
                   "else the last number; math: math-verify on the last \\boxed{}; dapo: math-verify on the last "
                   "line's 'Answer: ...' or else the last \\boxed{}; code: the reply's Python passes the task's tests in the "
                   "sandbox, auto for code rows such as HumanEval) or a 'package.module:function' path to "
                   "fn(completion, gold, *, strict) -> bool; an explicit value always wins; default auto")
    env: str = knob("", help="environment the rollouts talk to (docs/environments.md): '' = none, each reply "
                    "is scored once by reward.fn (single turn, as before); a registered environment's name "
                    "(calculator: the policy writes <calc>EXPR</calc>, the tool's <result>VALUE</result> comes back "
                    "in a user turn, a reply without a call is scored by arithmetic) or a 'package.module:Class' "
                    "path. The environment answers each reply with observation tokens (masked out of the loss) "
                    "until it is done, for at most generator.max_turns replies; its last step's verdict scores the "
                    "sample with reward.correct / reward.wrong, a truncated rollout gets reward.truncated. A "
                    "reward's name is refused here: a reward is the one-step environment, set it as reward.fn. "
                    "Default ''")
    env_step_timeout_s: float = knob(ENV_STEP_TIMEOUT_S, help="reward.env: longest one reset() or step() of the "
                                     "environment may run (each runs on a thread of the controller's, so a hung "
                                     "tool cannot hang the job); past it the job stops (exit 4) naming the task and "
                                     "where the environment was stuck. An environment bounds its own tools (its "
                                     "sandbox's or remote call's timeout, docs/environments.md); this catches one "
                                     "that does not (seconds, > 0); default 300")
    strict: bool = knob(False, help="strict answer format: arithmetic: the reply is only the number; gsm8k: "
                        "only the number after '####'; math: the last \\boxed{} ends the reply; dapo: only the last line's "
                        "'Answer: ...'; default False")
    correct: float = knob(1.0, help="reward of a finished reply whose final answer is right (reward units); "
                          "default 1")
    wrong: float = knob(0.0, help="reward of a wrong, missing or timed-out answer (reward units); default 0")
    truncated: Optional[float] = knob(None, help="reward of a reply cut off at max_new_tokens (finish reason "
                                      "'length'), whatever it says (reward units); default None = the wrong score")
    overlong_buffer: int = knob(0, help="DAPO soft overlong punishment: the last this-many tokens before "
                                "generator.max_new_tokens over which a finished reply's penalty ramps linearly "
                                "from 0 to overlong_penalty (tokens, >= 0; single-turn replies: refused with reward.env); "
                                "default 0 = off")
    overlong_penalty: float = knob(1.0, help="penalty subtracted at full length when overlong_buffer > 0 "
                                   "(reward units, >= 0); default 1")
    workers: int = knob(2, help="processes scoring the math reward and import-path rewards (processes); "
                        "default 2")
    timeout_s: float = knob(5.0, help="per-sample scoring time in the pool, counted from when a scoring "
                            "process takes the sample; past it the process is killed and replaced, the sample "
                            "scores the wrong score and is counted in reward/timeouts, and the job goes on "
                            "(seconds, > 0); default 5")
    max_error_frac: float = knob(0.25, help="largest fraction of a batch's scored (finished) replies on which "
                                 "the reward function may raise: each such reply scores the wrong score and is "
                                 "counted in reward/errors; more stops the job with the first traceback "
                                 "(fraction, 0..1; 0 = any error stops the job); default 0.25")
    code_sandbox_allow_weaker: List[str] = knob(
        default_factory=list, help="code reward (reward.fn=code): the sandbox mechanisms this machine may lack and "
        "you accept running replies without, from cgroup (per-run memory and process limits), ipc (IPC and UTS "
        "namespaces), mount (the mount namespace: without it the reply reads the host's world-readable files, a dataset's gold solutions included, so its score can be gamed), seccomp (the "
        "syscall filter). With a mechanism missing and not named here, the reward pool refuses to start in one "
        "line naming it; the network namespace and the uid switch are never optional (docs/environments.md); "
        "default [] = all required")
    code_sandbox_uid_base: int = knob(61000, help="code reward: the first of the sandbox's slot uids/gids (it uses "
                                      "this and the next 256); none may be a user or group of the machine, or "
                                      "the pool refuses to start (uid, > 0); default 61000")
    # --- a generative reward model (judge), megarl/reward/judge.py; docs/rewards.md ---
    model: str = knob("", help="generative reward model: an HF folder (config.json, weights, tokenizer) served "
                      "greedily by its own vLLM executor; it reads each finished reply in reward.judge_template and "
                      "its reply's last line 'SCORE: x' (x in 0..reward.judge_scale) scores it, replacing reward.fn "
                      "(reward = wrong + x/judge_scale * (correct - wrong); a reply cut at max_new_tokens still gets "
                      "reward.truncated, unjudged). An unparseable judge reply scores reward.wrong and is counted in "
                      "reward/errors (reward.max_error_frac applies). '' = no judge: reward.fn scores. Default ''")
    judge_template: str = knob("", help="the judge's prompt (one user turn, in the judge tokenizer's chat template): "
                               "text with {question}, {reply} and optionally {gold}; {reply} must stand between "
                               "the lines <<<REPLY>>> and <<<END REPLY>>> and {question} between <<<QUESTION>>> and "
                               "<<<END QUESTION>>> (what the judge is told is data), and it must ask for a last line "
                               "'SCORE: x'. '' = the built-in template (megarl/reward/judge_prompt.py "
                               "DEFAULT_TEMPLATE: correctness of the final answer against the gold answer). Default ''")
    judge_scale: int = knob(10, help="the top of the judge's score range: SCORE: 0 .. judge_scale, normalised to "
                            "0..1 (points, >= 1; 1 or 10 are usual). Default 10")
    judge_tp: int = knob(1, help="tensor-parallel size of each judge vLLM engine (GPUs per replica), its own, "
                         "not the generator's. Default 1")
    judge_replicas: int = knob(1, help="judge engine replicas, each its own process (replicas, >= 1). Default 1")
    judge_max_tokens: int = knob(256, help="longest judge reply (tokens); a judge reply cut there is unparseable "
                                 "(its last line may be a cut 'SCORE: 1' of 'SCORE: 10'). Default 256")
    judge_max_reply_tokens: int = knob(1024, help="longest judged reply quoted to the judge (judge tokens); a "
                                       "longer one keeps its first and last halves with a '[... N tokens cut "
                                       "...]' marker between. Default 1024")
    judge_max_model_len: int = knob(4096, help="longest judge prompt + judge reply the judge engine accepts "
                                    "(tokens); a prompt that leaves no room for judge_max_tokens is not sent and "
                                    "counts in reward/errors. Default 4096")
    judge_kv_cache_gib: int = knob(2, help="KV-cache memory per judge engine (GiB, integer). Default 2")
    judge_devices: str = knob("", help="GPU placement of the judge: CUDA device ids, judge_tp per replica, "
                              "replica-major ('4-5'); '' = the devices after the trainer's and the generator's "
                              "(with cluster.share_devices: the first ones, shared). Ignored on a CPU host. "
                              "Default ''")

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def fn_name(self) -> str:
        """The reward function to use: ``fn``, with an unresolved 'auto' as the default data's reward."""
        return AUTO_FALLBACK if self.fn == AUTO else self.fn

    def problems(self, max_new_tokens: Optional[int] = None) -> List[str]:
        """Every invalid value, each naming the key (empty when valid). ``max_new_tokens`` (the
        generator's) also checks that the overlong buffer fits in it."""
        found: List[str] = []
        fn_problem = _fn_problem(self.fn_name())
        if fn_problem:
            found.append(f"reward.fn={self.fn!r}: {fn_problem}")
        env_problem = _env_problem(self.env)
        if env_problem:
            found.append(f"reward.env={self.env!r}: {env_problem}")
        helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(self)}
        checks = [("timeout_s", self.timeout_s > 0), ("env_step_timeout_s", self.env_step_timeout_s > 0),
                  ("overlong_buffer", self.overlong_buffer >= 0),
                  ("overlong_penalty", self.overlong_penalty >= 0),
                  ("max_error_frac", 0 <= self.max_error_frac <= 1)]
        checks.append(("code_sandbox_uid_base", isinstance(self.code_sandbox_uid_base, int)
                       and 0 < self.code_sandbox_uid_base < (1 << 31) - 512))
        found += [f"reward.{name}={getattr(self, name)!r} is out of range: {helps[name]}"
                  for name, ok in checks if not ok]
        from megarl.reward.jail import MECHANISMS  # stdlib only

        weaker = self.code_sandbox_allow_weaker
        if isinstance(weaker, (list, tuple)) and set(weaker) - set(MECHANISMS):  # the loader checks it is a list
            found.append(f"reward.code_sandbox_allow_weaker={weaker!r}: a list of {', '.join(MECHANISMS)} (the sandbox "
                         f"mechanisms one accepts missing)")
        from megarl.reward.judge_prompt import judge_problems  # stdlib only

        found += judge_problems(self)
        if self.correct <= self.wrong:
            found.append(f"reward.correct={self.correct!r} must be greater than reward.wrong={self.wrong!r}, "
                         f"or a right answer is not rewarded")
        if max_new_tokens is not None and self.overlong_buffer > max_new_tokens:
            found.append(f"reward.overlong_buffer={self.overlong_buffer} exceeds generator.max_new_tokens="
                         f"{max_new_tokens}: the ramp starts at max_new_tokens - overlong_buffer tokens; "
                         f"use at most {max_new_tokens}")
        return found


def _env_problem(spec: object) -> Optional[str]:
    """Why ``spec`` names no multi-step environment ('' is none: single turn), found without importing
    an import path's module (as for reward.fn)."""
    from megarl.reward.environment import multi_step_environments  # torch-free
    from megarl.reward.registry import known_rewards

    if spec == "":
        return None
    if not isinstance(spec, str):
        return "must be a string: an environment's name or a 'package.module:Class' path"
    if ":" in spec:
        return _fn_problem(spec)
    if spec in multi_step_environments():
        return None
    if spec in known_rewards():
        return (f"{spec!r} is a reward (the one-step environment): set reward.fn={spec} and leave reward.env "
                f"empty")
    return (f"unknown environment; known: {', '.join(multi_step_environments())}, or a 'package.module:Class' "
            f"path")


def _fn_problem(spec: object) -> Optional[str]:
    """Why ``spec`` names no reward, found without importing it (so no torch): a registered name, or a
    module that exists and, where its source can be read, defines the function at top level."""
    from megarl.reward.registry import known_rewards, unknown_message  # torch- and sympy-free

    if not isinstance(spec, str) or not spec or ":" not in spec:
        # The built-ins, and names registered by code imported earlier (a plugin calling register_reward).
        return None if spec in known_rewards() else unknown_message(spec)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        return "an import path must look like 'package.module:function'"
    try:
        module_spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        return f"cannot find module {module_name!r} ({exc})"
    if module_spec is None:
        return f"cannot find module {module_name!r} (is it on PYTHONPATH?)"
    origin = module_spec.origin
    if not origin or not origin.endswith(".py"):
        return None  # an extension or namespace module: checked when the reward is built
    try:
        tree = ast.parse(open(origin, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError) as exc:
        return f"cannot read {origin}: {exc}"
    top = attr.split(".")[0]
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None  # a star import may define anything
                defined.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    if top not in defined:
        return f"module {module_name!r} ({origin}) defines no top-level {top!r}"
    return None

