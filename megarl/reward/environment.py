"""Environments: one interface for a single-turn reward and a multi-turn tool loop.

An environment is what a rollout talks to (docs/environments.md)::

    env = get_environment("code", tokenizer=tok, strict=False)
    state = env.reset(task)                 # state.messages: the prompt's chat messages
    step = env.step(state, reply_ids)       # the policy's reply, as the token ids it sampled
    step.observation                        # token ids to append (a tool's answer), or None when done
    step.done, step.reward, step.info       # info: {'correct', 'reason', ...}

Contract:

- **Tokens.** The generator owns the sampled tokens; the environment owns the tokens of its
  observations (it tokenizes them itself, separators included) and never re-encodes earlier turns.
  It decodes ``reply_ids`` only to read them.
- **Blocking.** ``step`` may block (a tool runs, a sandbox executes) but must return within its own
  timeout; it runs in the reward pool's scoring processes or the controller, never in the engine.
- **Timeouts.** A step that runs code enforces a wall-clock limit (the code sandbox's, below
  ``reward.timeout_s``); past it the step is done with reward 0 and ``info['reason']`` says so.

Every registered reward (megarl/reward/registry.py) is an environment of one step
(:class:`RewardEnvironment`), scoring exactly as the reward does. Environments of more steps register
with :func:`register_environment`, or are named by a ``package.module:Class`` import path.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from megarl.reward.registry import explain, get_reward, known_rewards

_ENVIRONMENTS: Dict[str, Callable[..., "Environment"]] = {}


@dataclasses.dataclass
class EnvState:
    """One rollout's state: the task, its prompt messages, the turns so far and anything the
    environment keeps (``extra``)."""

    task: Any
    messages: List[Dict[str, str]]
    turn: int = 0
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step gives back: ``observation`` (token ids to append before the next reply; None
    when ``done``), ``reward`` (set when done), ``info`` ('correct', 'reason', ...)."""

    observation: Optional[List[int]]
    done: bool
    reward: Optional[float] = None
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    """``reset`` and ``step`` (docs/environments.md, "The contract"). An environment whose ``step`` may
    run for several rollouts at once (no shared mutable state, or its own locking) says so with a class
    attribute ``concurrent_steps = True``: the multi-turn loop then steps a turn's rollouts in parallel
    threads (megarl/controller/turns.py), so a slow tool (a sandbox, a remote call) costs one wait per
    turn, not one per rollout. Absent or False: one rollout at a time. Either way each call runs on a
    thread of the controller's, bounded by ``reward.env_step_timeout_s``."""

    name: str

    def reset(self, task: Any) -> EnvState: ...

    def step(self, state: EnvState, reply_ids: Sequence[int]) -> StepResult: ...


def task_messages(task: Any) -> List[Dict[str, str]]:
    """The chat messages of a data Task (its own messages, else one user turn of its question)."""
    messages = getattr(task, "messages", ()) or ()
    if messages:
        return [{"role": r, "content": c} for r, c in messages]
    return [{"role": "user", "content": getattr(task, "question", str(task))}]


class RewardEnvironment:
    """A reward as a one-step environment: the reply is scored by the reward function, with the
    same verdict as RewardPool's (``correct`` / ``wrong`` scores of reward.correct / reward.wrong)."""

    def __init__(self, fn: str, *, tokenizer: Any = None, strict: bool = False, correct: float = 1.0,
                 wrong: float = 0.0):
        self.name, self.fn, self.tokenizer = fn, get_reward(fn), tokenizer
        self.strict, self.correct, self.wrong = strict, correct, wrong

    def reset(self, task: Any) -> EnvState:
        return EnvState(task, task_messages(task))

    def step(self, state: EnvState, reply_ids: Sequence[int]) -> StepResult:
        if self.tokenizer is None:
            raise ValueError(f"environment {self.name!r}: step() needs a tokenizer to read the reply; "
                             f"pass tokenizer=, or call score_text()")
        return self.score_text(state, self.tokenizer.decode(list(reply_ids)))

    def score_text(self, state: EnvState, reply: str) -> StepResult:
        """The one step from the reply's text (what ``megarl reward check`` calls)."""
        state.turn += 1
        try:
            ok, reason = explain(self.fn, reply, state.task.answer, strict=self.strict)
        except Exception as exc:  # noqa: BLE001 - the pool counts these as errors; here it is the reason
            ok, reason = False, f"the reward raised {type(exc).__name__}: {exc}"
        return StepResult(None, True, self.correct if ok else self.wrong, {"correct": ok, "reason": reason})


def register_environment(name: str) -> Callable:
    """Decorator: register an environment factory ``factory(*, tokenizer, strict, **kw) -> Environment``."""
    if not name or ":" in name or name in known_rewards():
        raise ValueError(f"environment name {name!r} must be non-empty, without ':', and not a reward's name")

    def decorator(factory: Callable) -> Callable:
        _ENVIRONMENTS[name] = factory
        return factory

    return decorator


def multi_step_environments() -> List[str]:
    """The registered environments of more than one step (what ``reward.env`` takes by name)."""
    return sorted(_ENVIRONMENTS)


def environment_instruction(spec: str) -> Optional[str]:
    """What an environment asks the prompt to say (its factory's ``instruction`` attribute: how to call
    its tool), or None; ``data.instruction: auto`` uses it in place of the data's own."""
    factory: Any = _ENVIRONMENTS.get(spec)
    if factory is None and ":" in spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr, None)
    return getattr(factory, "instruction", None)


def known_environments() -> List[str]:
    """Every name ``get_environment`` takes: the registered environments and every reward."""
    return sorted(set(_ENVIRONMENTS) | set(known_rewards()))


def get_environment(spec: str, **kwargs: Any) -> Environment:
    """The environment ``spec``: a registered one, a reward (one step), or ``package.module:Name``
    (a class or factory of an environment, else a reward function). ValueError when it names none."""
    if spec in _ENVIRONMENTS:
        return _ENVIRONMENTS[spec](**kwargs)
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr, None)
        except ImportError as exc:
            raise ValueError(f"environment {spec!r}: cannot import {module!r}: {exc}") from None
        if isinstance(obj, type) and hasattr(obj, "step") and hasattr(obj, "reset"):
            return obj(**kwargs)
    known = ", ".join(known_environments())
    try:
        return RewardEnvironment(spec, **kwargs)
    except ValueError:
        raise ValueError(f"environment {spec!r}: not an environment or a reward; known: {known}, or a "
                         f"'module:Class' path") from None
