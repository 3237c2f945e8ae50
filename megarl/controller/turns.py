"""Multi-turn rollouts, token in, token out: the policy replies, an environment answers with
observation tokens, the policy continues from exactly those tokens, until the environment is done.

Each turn is one generator call whose prompt is the previous turn's prompt + the tokens the policy
sampled + the observation's tokens (as the environment tokenized them). Nothing is decoded and
re-encoded: the trained sequence is, token by token, the prompt, each reply as sampled and each
observation as given. In the resulting :class:`~megarl.rollout.Sample`:

- ``completion_ids`` = reply 1 + observation 1 + reply 2 + ...;
- ``loss_mask`` 1 on reply tokens, 0 on observation tokens, whose ``behav_logprobs`` are 0 and
  ``versions`` -1: an observation's logprobs are neither asked of the engine (it is a prompt there,
  and vLLM computes no prompt logprobs unless asked) nor used;
- ``versions`` per reply token as each turn's engine reported them, so a partial rollout resumed
  after a weight update inside a turn shows the switch as in single turn;
- ``routed_experts`` (an MoE model) per token as the latest turn that ran it routed it: each turn's
  request runs the whole context again (prompt, replies, observations; a prefix-cache hit reports the
  routing its KV blocks recorded), so every token but the last has the routing of the weights that
  sampled the last reply (``merge_rounds``, as a partial rollout's rounds);
- ``finish_reason`` 'length' (truncated) when ``generator.max_turns`` replies were given without the
  environment being done, when the next observation and one reply token would not fit
  ``generator.max_model_len`` (the observation is then not appended), or when a
  reply itself hit its token limit; ``turns``: replies given.

The environment's reward (``StepResult.reward``) and verdict are set on the sample; a truncated
rollout gets ``truncated_score``.

:func:`multi_turn` drives rollouts from their prompts; :func:`continue_rollouts` from first replies
sampled elsewhere (in ``megarl train``: the rollout queue's, admitted and lag-checked as in single
turn), which :class:`EnvironmentTurns` does for the loop when ``reward.env`` is set
(docs/environments.md).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megarl.reward.config import ENV_STEP_TIMEOUT_S
from megarl.rollout import Sample, merge_rounds

log = logging.getLogger(__name__)
# Threads that step one turn's rollouts at once, for an environment with ``concurrent_steps = True``
# (megarl.reward.environment.Environment): each waits on its tool (a sandbox run, a remote call), so
# more threads than cores is the point; a turn of more rollouts queues behind these (count).
ENV_STEP_THREADS = 16


class EnvironmentFailed(RuntimeError):
    """The environment's ``reset`` or ``step`` raised: the job stops (exit 8, as a reward that cannot
    run), the message naming the environment, the rollout's task and the environment's traceback."""


class EnvironmentStepTimeout(TimeoutError):
    """The environment's ``reset`` or ``step`` ran past ``reward.env_step_timeout_s``: the job stops
    (exit 4), the message naming the rollout's task and where the environment's thread was stuck."""


@dataclasses.dataclass
class _Rollout:
    state: Any
    prompt: List[int]
    task: Any = None  # what reset() was given: named in an environment's error
    ids: List[int] = dataclasses.field(default_factory=list)
    mask: List[int] = dataclasses.field(default_factory=list)
    logprobs: List[float] = dataclasses.field(default_factory=list)
    versions: List[int] = dataclasses.field(default_factory=list)
    turns: int = 0
    rounds: int = 0
    done: bool = False
    finish: str = ""
    stop_reason: Any = None
    reward: Optional[float] = None
    correct: Optional[bool] = None
    formatted: Optional[bool] = None
    experts: Optional[list] = None  # routed experts of context so far (an MoE model's; None: not reported)

    @property
    def context(self) -> List[int]:
        return self.prompt + self.ids


def multi_turn(generator, env, tasks: Sequence[Any], prompts: Sequence[Sequence[int]], *, max_turns: int,
               max_new_tokens: int, max_model_len: int, truncated_score: float = 0.0,
               sampling: Optional[dict] = None, step_timeout_s: float = ENV_STEP_TIMEOUT_S) -> List[Sample]:
    """One multi-turn rollout per (task, prompt token ids), driven turn by turn on ``generator``
    (a :class:`~megarl.executors.base.Generator`: its ``generate``) with ``env`` (an
    :class:`~megarl.reward.environment.Environment`); returns one Sample per task, in order. Each
    ``reset``/``step`` is bounded by ``step_timeout_s`` (:class:`EnvironmentStepTimeout`)."""
    if max_turns < 1:
        raise ValueError(f"generator.max_turns={max_turns}: must be >= 1")
    states = _bounded(env, "reset", [lambda t=t: env.reset(t) for t in tasks], tasks, workers=1, timeout_s=step_timeout_s)
    runs = [_Rollout(state, [int(t) for t in prompt], task=task) for state, prompt, task in zip(states, prompts, tasks)]
    _play(generator, env, runs, turns=range(max_turns), max_turns=max_turns, max_new_tokens=max_new_tokens,
          max_model_len=max_model_len, sampling=sampling, timeout_s=step_timeout_s)
    return [_sample(r, Sample(r.prompt, [], [], [], "stop", group_id=i, prompt_index=i), truncated_score)
            for i, r in enumerate(runs)]


def continue_rollouts(generator, env, tasks: Sequence[Any], firsts: Sequence[Sample], *, max_turns: int,
                      max_new_tokens: int, max_model_len: int, truncated_score: float = 0.0,
                      sampling: Optional[dict] = None, step_timeout_s: float = ENV_STEP_TIMEOUT_S) -> List[Sample]:
    """The rollouts whose first reply the generator already sampled (``firsts``, e.g. a step's samples
    from the rollout queue, admitted and lag-checked as in single turn; ``tasks[s.prompt_index]`` is
    each one's task), carried on turn by turn as :func:`multi_turn` does. Each returned Sample keeps
    its first's ids (group, prompt, sample index, uid). Later turns run on the weights the engines hold
    now: a turn sampled after a weight update carries the new version on its tokens."""
    if max_turns < 1:
        raise ValueError(f"generator.max_turns={max_turns}: must be >= 1")
    own = [tasks[s.prompt_index] for s in firsts]
    states = _bounded(env, "reset", [lambda t=t: env.reset(t) for t in own], own, workers=1, timeout_s=step_timeout_s)
    runs = []
    for s, state, task in zip(firsts, states, own):
        r = _Rollout(state, [int(t) for t in s.prompt_ids], task=task)
        _take_reply(r, s)
        runs.append(r)
    _step_all(env, runs, last_turn=max_turns == 1, max_model_len=max_model_len, timeout_s=step_timeout_s)
    _play(generator, env, runs, turns=range(1, max_turns), max_turns=max_turns, max_new_tokens=max_new_tokens,
          max_model_len=max_model_len, sampling=sampling, timeout_s=step_timeout_s)
    return [_sample(r, s, truncated_score) for r, s in zip(runs, firsts)]


def turn_metrics(samples: Sequence[Sample]) -> Dict[str, float]:
    """How many turns the step's rollouts took: mean and most replies per sample, the share with more
    than one, and the observation tokens (masked out of the loss) in the batch."""
    n = max(len(samples), 1)
    return {"gen/turns_mean": sum(s.turns for s in samples) / n,
            "gen/turns_max": float(max((s.turns for s in samples), default=0)),
            "gen/multi_turn_frac": sum(s.turns > 1 for s in samples) / n,
            "gen/observation_tokens": float(sum(len(s.loss_mask or []) - sum(s.loss_mask or []) for s in samples))}


class EnvironmentTurns:
    """``reward.env`` in the RL loop: :meth:`play` carries a step's first replies on with the
    environment (the generator and the environment are passed in; the controller owns both)."""

    def __init__(self, generator, env, *, max_turns: int, max_new_tokens: int, max_model_len: int,
                 truncated_score: float, step_timeout_s: float = ENV_STEP_TIMEOUT_S):
        self.generator, self.env = generator, env
        self.limits = dict(max_turns=max_turns, max_new_tokens=max_new_tokens, max_model_len=max_model_len,
                           truncated_score=truncated_score, step_timeout_s=step_timeout_s)

    def play(self, tasks: Sequence[Any], samples: Sequence[Sample]) -> Tuple[List[Sample], Dict[str, float]]:
        """(the finished, scored rollouts in the order of ``samples``, the step's turn metrics)."""
        out = continue_rollouts(self.generator, self.env, tasks, samples, **self.limits)
        return out, turn_metrics(out)


def _play(generator, env, runs: List[_Rollout], *, turns: range, max_turns: int, max_new_tokens: int,
          max_model_len: int, sampling: Optional[dict], timeout_s: float) -> None:
    for turn in turns:
        live = [r for r in runs if not r.done]
        if not live:
            break
        limits = {id(r): min(max_new_tokens, max_model_len - len(r.context) - 1) for r in live}
        for r in live:
            if limits[id(r)] < 1:  # no room for one more token: the context cap ends it
                r.done, r.finish = True, "length"
        live = [r for r in live if not r.done]
        # One call per distinct limit keeps every request within the context cap.
        for limit in sorted({limits[id(r)] for r in live}):
            group = [r for r in live if limits[id(r)] == limit]
            samples = generator.generate([r.context for r in group], n_samples=1, max_new_tokens=limit,
                                         sampling=sampling)
            for r, s in zip(group, samples):
                _take_reply(r, s)
            _step_all(env, group, last_turn=turn == max_turns - 1, max_model_len=max_model_len, timeout_s=timeout_s)


def _sample(r: _Rollout, base: Sample, truncated_score: float) -> Sample:
    """``base`` (its ids) with the rollout's tokens, mask, versions, turns and verdict."""
    truncated = r.finish == "length"
    routed = base.routed_experts if r.experts is None else r.experts
    return dataclasses.replace(base, completion_ids=r.ids, behav_logprobs=r.logprobs, versions=r.versions,
                               routed_experts=routed,
                               finish_reason=r.finish or "stop", stop_reason=r.stop_reason, num_rounds=r.rounds,
                               reward=truncated_score if truncated else r.reward,
                               correct=bool(r.correct) and not truncated,
                               formatted=bool(r.formatted) and not truncated, loss_mask=r.mask, turns=r.turns)


def _take_reply(r: _Rollout, s: Sample) -> None:
    if s.prompt_ids != r.context:  # the engine must have continued from exactly our tokens
        raise RuntimeError(f"multi-turn: the generator returned a sample for another prompt "
                           f"({len(s.prompt_ids)} tokens, expected {len(r.context)})")
    r.ids += s.completion_ids
    if s.routed_experts is not None:  # this turn's request ran the whole context: its routing is the latest
        r.experts = merge_rounds(r.experts, s.routed_experts, len(r.context))
    r.mask += [1] * len(s.completion_ids)
    r.logprobs += list(s.behav_logprobs)
    r.versions += list(s.versions)
    r.turns += 1
    r.rounds += s.num_rounds
    r.stop_reason = s.stop_reason
    if s.finish_reason == "length":
        r.done, r.finish = True, "length"


def _step_all(env, runs: List[_Rollout], *, last_turn: bool, max_model_len: int, timeout_s: float) -> None:
    """:func:`_step` for each live rollout: up to ENV_STEP_THREADS at once when the environment allows
    it (each call touches only its own rollout), else one at a time; either way each step is bounded by
    ``timeout_s`` (:func:`_bounded`)."""
    live = [r for r in runs if not r.done]
    workers = min(ENV_STEP_THREADS, len(live)) if getattr(env, "concurrent_steps", False) else 1
    calls = [lambda r=r: _step(env, r, last_turn=last_turn, max_model_len=max_model_len) for r in live]
    _bounded(env, "step", calls, [r.task for r in live], workers=workers, timeout_s=timeout_s)


def _bounded(env, what: str, calls: Sequence[Callable[[], Any]], tasks: Sequence[Any], *, workers: int,
             timeout_s: float) -> List[Any]:
    """Each of ``calls`` (the environment's ``what``, one per rollout, for ``tasks``), at most
    ``workers`` at a time, on daemon threads: the caller waits for them with a timeout, so an
    environment that never returns stops the job (:class:`EnvironmentStepTimeout`, naming the task and
    the stuck thread's stack) instead of hanging it, and the abandoned thread does not hold up the
    process's exit. The first call that raises stops the rest (:class:`EnvironmentFailed`)."""
    results: List[Any] = [None] * len(calls)
    if not calls:
        return results
    finished: "queue.SimpleQueue[Tuple[int, Optional[BaseException]]]" = queue.SimpleQueue()
    started: Dict[int, Tuple[int, float]] = {}  # call -> (its thread's ident, when it started)
    order, lock, stop = iter(range(len(calls))), threading.Lock(), threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                i = next(order, None)
                if i is None:
                    return
                started[i] = (threading.get_ident(), time.monotonic())
            try:
                results[i] = calls[i]()
                finished.put((i, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                finished.put((i, exc))

    for _ in range(min(workers, len(calls))):
        threading.Thread(target=work, name=f"env-{what}", daemon=True).start()
    name = getattr(env, "name", type(env).__name__)
    pending = set(range(len(calls)))
    try:
        while pending:
            with lock:
                running = [(t0, i, ident) for i, (ident, t0) in started.items() if i in pending]
            oldest = min(running, default=None)
            wait = min(timeout_s, 1.0) if oldest is None else oldest[0] + timeout_s - time.monotonic()
            try:
                i, exc = finished.get(timeout=max(wait, 0.0))
            except queue.Empty:
                if oldest is not None and time.monotonic() - oldest[0] >= timeout_s:
                    _, i, ident = oldest
                    raise EnvironmentStepTimeout(
                        f"reward.env={name!r}: {what}() for task {_describe(tasks[i])} has run for {timeout_s:g} s "
                        f"(reward.env_step_timeout_s): an environment's {what} must return within its own "
                        f"timeout (docs/environments.md, the contract); where it was stuck:\n{_stack(ident)}") from None
                continue
            pending.discard(i)
            if exc is not None:
                raise EnvironmentFailed(f"reward.env={name!r}: {what}() raised {type(exc).__name__}: {exc} "
                                        f"(task {_describe(tasks[i])})") from exc
    finally:
        stop.set()  # a failure or timeout: hand out no more calls
    return results


def _describe(task: Any) -> str:
    text = str(getattr(task, "question", task))
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _stack(ident: int) -> str:
    frame = sys._current_frames().get(ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(the thread has just finished)"


def _step(env, r: _Rollout, *, last_turn: bool, max_model_len: int) -> None:
    if r.done:
        return
    step = env.step(r.state, r.ids[-_reply_len(r):])
    if step.done:
        r.done, r.finish = True, "stop"
        r.reward, r.correct = step.reward, step.info.get("correct")
        r.formatted = step.info.get("formatted", r.correct)  # an answer could be read (reward/format_rate)
        return
    if last_turn:
        r.done, r.finish = True, "length"  # generator.max_turns replies and the environment still wants more
        return
    obs = [int(t) for t in step.observation or []]
    if len(r.context) + len(obs) + 1 > max_model_len:
        r.done, r.finish = True, "length"  # the observation leaves no room for a reply: the context cap
        return
    r.ids += obs
    r.mask += [0] * len(obs)
    r.logprobs += [0.0] * len(obs)
    r.versions += [-1] * len(obs)


def _reply_len(r: _Rollout) -> int:
    """Tokens of the last reply: the trailing run of sampled (mask 1) tokens."""
    n = 0
    for m in reversed(r.mask):
        if not m:
            break
        n += 1
    return n
