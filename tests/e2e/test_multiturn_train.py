"""`megarl train` with a multi-turn environment (reward.env), end to end on the tiny model: real vLLM
engine, real Megatron trainer, the calculator tool answering in user turns through the model's chat
template. Checked on what the trainer was given, token by token: every trained sequence is the prompt,
each reply as the engine sampled it and each observation as the environment tokenized it; the loss
mask is 0 exactly at the observation tokens (and the prompt); and, with max_policy_lag 1, a turn
sampled after the step-1 weight update carries version 1 while its first reply was sampled at 0.

The controller runs in this process (its executors in their own, as always), so the test can watch the
samples the engines returned (GeneratorExecutor.collect/poll) and the batches the trainer trained
(TrainerExecutor.step) without changing either."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megarl.reward.environment import EnvState
from megarl.reward.tools import Calculator

REPO = Path(__file__).resolve().parents[2]
OBSERVATIONS: dict[tuple[int, ...], list[list[int]]] = {}  # reply ids -> observation ids the env answered


class CallsOnce(Calculator):
    """The calculator, with a random policy's first reply of each rollout read as a call of ``6*7`` (a
    random tiny model never writes ``<calc>...</calc>``); everything else is the calculator's: the
    ``<result>42</result>`` user turn tokenized through the chat template, the final reply scored by
    ``arithmetic``."""

    def call_in(self, state: EnvState, text: str):
        return super().call_in(state, text) or (None if state.extra.get("calls") else "6*7")

    def step(self, state, reply_ids):
        result = super().step(state, reply_ids)
        if result.observation is not None:
            OBSERVATIONS.setdefault(tuple(reply_ids), []).append(list(result.observation))
        return result


def _spy(monkeypatch, cls, name: str, record) -> None:
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        record(args, out)
        return out

    monkeypatch.setattr(cls, name, wrapper)


def test_train_with_the_calculator_masks_observations_and_versions_turns(tiny_llama_dir, tmp_path, monkeypatch):
    from megarl.config import load_config
    from megarl.controller import run_job
    from megarl.generator.executor import GeneratorExecutor
    from megarl.trainer.executor import TrainerExecutor

    engine_samples: dict[tuple[int, ...], list] = {}  # prompt ids -> samples the engine returned for them
    batches: list = []
    keep = lambda _args, out: [engine_samples.setdefault(tuple(s.prompt_ids), []).append(s) for s in out]  # noqa: E731
    _spy(monkeypatch, GeneratorExecutor, "collect", keep)
    _spy(monkeypatch, GeneratorExecutor, "poll", keep)
    _spy(monkeypatch, TrainerExecutor, "step", lambda args, _out: batches.append(args[0]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the job hides CUDA; restored after the test
    OBSERVATIONS.clear()
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_dir}", f"logging.out_dir={tmp_path}", "controller.eval_every=0",
        f"reward.env={__name__}:CallsOnce", "generator.max_turns=3", "generator.max_new_tokens=8",
        # A random model seldom samples EOS; a stop string of common letters ends its replies within a
        # few tokens, so a reply finishes ('stop') and the environment answers it.
        "generator.stop=[e, a, o, i]", "controller.max_policy_lag=1", "trainer.checkpoint_interval=0",
        # cheap: 2 prompts x 2 samples a step, a small engine (prompt ~60 + 2 replies + one observation fit)
        "controller.prompts_per_step=2", "generator.kv_cache_gib=1", "generator.max_model_len=256",
        "algorithm.entropy_coef=0.01"])
    assert run_job(cfg) == 0

    rows = [json.loads(line) for line in (tmp_path / "tiny-test" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(batches) == 2
    multi = after_update = 0
    for step, (batch, row) in enumerate(zip(batches, rows), start=1):
        turns_seen, observed = [], 0
        for b in range(batch.batch_size):
            tokens = batch.input_ids[b, :int(batch.lengths[b])].tolist()
            expect, turn_versions, n_obs = _walk(tokens, engine_samples)
            n = len(tokens)
            # 0 exactly at the prompt and the observations, 1 at every reply token
            assert batch.loss_mask[b, :n].tolist() == expect["mask"]
            # each reply token's version and logprob as its engine reported them; -1 and 0 off the replies
            assert batch.versions[b, :n].tolist() == expect["versions"]
            assert torch.equal(batch.behav_logprobs[b, :n], torch.tensor(expect["logprobs"], dtype=torch.float32))
            turns_seen.append(len(turn_versions))
            observed += n_obs
            if len(turn_versions) > 1 and step == 2:
                # The first reply was generated ahead (lag 1) at weights v0; the later turns ran after the
                # step-1 update landed: every token of them carries version 1.
                assert turn_versions[0] == {0} and all(v == {1} for v in turn_versions[1:]), turn_versions
                after_update += 1
        multi += sum(t > 1 for t in turns_seen)
        assert row["gen/turns_mean"] == sum(turns_seen) / len(turns_seen)
        assert row["gen/turns_max"] == max(turns_seen)
        assert row["gen/multi_turn_frac"] == sum(t > 1 for t in turns_seen) / len(turns_seen)
        assert row["gen/observation_tokens"] == observed
    assert multi >= 1 and after_update >= 1  # multi-turn samples were trained, in step 2 too


def _walk(tokens: list[int], engine_samples: dict) -> tuple[dict[str, list], list[set[int]], int]:
    """Reads ``tokens`` as prompt, reply (a sample the engine returned for exactly the tokens before
    it), observation (what the environment answered that reply), reply, ...; fails unless every
    token is accounted for. Returns the loss mask, versions and behaviour logprobs that sequence must
    be trained with, each reply's versions and the number of observation tokens."""
    pos = _first_prompt_len(tokens, engine_samples)
    expect = {"mask": [0.0] * pos, "versions": [-1] * pos, "logprobs": [0.0] * pos}
    versions, n_obs = [], 0
    while pos < len(tokens):
        reply = next((s for s in engine_samples.get(tuple(tokens[:pos]), [])
                      if tokens[pos:pos + len(s.completion_ids)] == s.completion_ids), None)
        assert reply is not None, f"tokens {pos}.. are no reply the engine sampled after the tokens before them"
        pos += len(reply.completion_ids)
        expect["mask"] += [1.0] * len(reply.completion_ids)
        expect["versions"] += list(reply.versions)
        expect["logprobs"] += list(reply.behav_logprobs)
        versions.append(set(reply.versions))
        if pos == len(tokens):
            break
        obs = next((o for o in OBSERVATIONS.get(tuple(reply.completion_ids), [])
                    if tokens[pos:pos + len(o)] == o), None)
        assert obs is not None, f"tokens {pos}.. follow a reply but are not the environment's observation"
        pos += len(obs)
        n_obs += len(obs)
        expect["mask"] += [0.0] * len(obs)
        expect["versions"] += [-1] * len(obs)
        expect["logprobs"] += [0.0] * len(obs)
    return expect, versions, n_obs


def _first_prompt_len(tokens: list[int], engine_samples: dict) -> int:
    return min(len(p) for p in engine_samples if list(p) == tokens[:len(p)])


def test_reward_env_names_an_environment_or_says_what_to_change():
    """reward.env is checked when the config loads (no torch, no engine): each bad value is one line
    naming the key and what to write instead; empty (the default) is the single-turn job of before."""
    import pytest

    from megarl.config import ConfigError, load_config

    base = REPO / "configs" / "tiny_test.yaml"
    assert load_config(base, []).reward.env == ""
    turns = "generator.max_turns=3"  # an environment needs >= 2 (the test below)
    assert load_config(base, ["reward.env=calculator", turns]).reward.env == "calculator"
    assert load_config(base, [f"reward.env={__name__}:CallsOnce", turns]).reward.env.endswith(":CallsOnce")
    for value, says in (("calcu", "unknown environment; known: calculator, or a 'package.module:Class' path"),
                        ("gsm8k", "'gsm8k' is a reward (the one-step environment): set reward.fn=gsm8k and "
                                  "leave reward.env empty"),
                        ("no_such_module:Env", "cannot find module 'no_such_module'"),
                        (f"{__name__}:NoSuchEnv", "defines no top-level 'NoSuchEnv'")):
        with pytest.raises(ConfigError) as err:
            load_config(base, [f"reward.env={value}", turns])
        problems = [line for line in str(err.value).splitlines() if "reward.env" in line]
        assert len(problems) == 1 and says in problems[0], str(err.value)


def test_an_environment_with_one_turn_is_refused_before_the_job_starts():
    """generator.max_turns=1 (the default) with reward.env set would end every rollout truncated after
    its first reply: refused in one line naming the key."""
    import pytest

    from megarl.config import ConfigError, load_config

    base = REPO / "configs" / "tiny_test.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(base, ["reward.env=calculator"])
    (line,) = [p for p in str(err.value).splitlines() if "max_turns" in p]
    assert "generator.max_turns=1: reward.env='calculator'" in line and "max_turns >= 2" in line
    assert load_config(base, ["reward.env=calculator", "generator.max_turns=2"]).generator.max_turns == 2
    assert load_config(base, []).generator.max_turns == 1  # single turn: no environment, no refusal


def test_an_overlong_ramp_with_an_environment_is_refused():
    """reward.overlong_buffer shapes a single reply's reward; an environment's reward is the whole
    rollout's and the ramp would be silently ignored: refused in one line naming the key."""
    import pytest

    from megarl.config import ConfigError, load_config

    base = REPO / "configs" / "tiny_test.yaml"
    env = ["reward.env=calculator", "generator.max_turns=3"]
    with pytest.raises(ConfigError) as err:
        load_config(base, [*env, "reward.overlong_buffer=4"])
    (line,) = [p for p in str(err.value).splitlines() if "overlong" in p]
    assert "reward.overlong_buffer=4:" in line and "set reward.overlong_buffer=0" in line, line
    assert load_config(base, [*env]).reward.overlong_buffer == 0
    assert load_config(base, ["reward.overlong_buffer=4"]).reward.overlong_buffer == 4  # single turn: allowed
