"""Multi-turn rollouts on a real vLLM engine: the trained sequence is, token by token, the prompt,
each reply as sampled and each observation as the environment tokenized it (SmolLM2's chat template
puts <|im_end|>\\n<|im_start|>user\\n ... <|im_start|>assistant\\n between turns); observations are
out of the loss; max_turns and the context cap end a rollout as truncated; the calculator tool."""

from __future__ import annotations

from fractions import Fraction

import threading

import pytest
import torch
from transformers import AutoTokenizer

from megarl.batch import RolloutBatch
from megarl.controller.turns import multi_turn
from megarl.data.tasks import Task
from megarl.generator.config import GeneratorConfig
from megarl.generator.executor import GeneratorExecutor
from megarl.reward.environment import EnvState, StepResult, get_environment
from megarl.reward.tools import calculate, turn_ids

# A random model seldom samples EOS; a stop string of common letters ends its replies within a few
# tokens, so each reply finishes ('stop') and the environment answers it.
STOP = {"stop": ["e", "a", "o", "i"]}
TASKS = [Task("What is 12 * 7 + 3?", "87"), Task("What is 2 ** 10?", "1024")]


class ToolEveryTurn:
    """An environment that answers every reply with a tool turn, through the model's chat template,
    for ``turns - 1`` replies, then ends with reward 1: every rollout is multi-turn whatever a random
    model says."""

    name = "tool-every-turn"

    def __init__(self, tokenizer, turns: int):
        self.tokenizer, self.turns = tokenizer, turns
        self.observations: dict = {}

    def reset(self, task):
        return EnvState(task, [{"role": "user", "content": task.question}])

    def step(self, state, reply_ids):
        state.turn += 1
        if state.turn >= self.turns:
            return StepResult(None, True, 1.0, {"correct": True})
        obs = turn_ids(self.tokenizer, state.messages, f"<result>{state.turn}</result>", reply_ids)
        self.observations.setdefault(state.task.question, []).append(obs)
        return StepResult(obs, False)


class Spy:
    """The generator, with every call's prompts and samples kept (what the engine saw and sampled)."""

    def __init__(self, gen):
        self.gen, self.calls = gen, []

    def generate(self, prompts, **kw):
        out = self.gen.generate(prompts, **kw)
        self.calls.append(([list(p) for p in prompts], out))
        assert [x.prompt_ids for x in out] == [list(p) for p in prompts]
        return out


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def gen(tiny_llama_dir, tmp_path_factory):
    # fp32: the new-weights test compares the engine's logprobs with the trainer's at the fp32 bound
    cfg = GeneratorConfig(dtype="float32", temperature=1.0, n_samples=1, max_new_tokens=8, max_model_len=160, kv_cache_gib=1,
                          seed=7, start_timeout_s=300, request_timeout_s=120, shutdown_timeout_s=20,
                          log_dir=str(tmp_path_factory.mktemp("turn_logs")))
    ex = GeneratorExecutor(cfg, tiny_llama_dir).start()
    yield ex
    ex.shutdown()


def _prompts(tok, envs_states):
    return [tok.encode(tok.apply_chat_template(s.messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for s in envs_states]


def test_trained_tokens_are_sampled_plus_observation_tokens(gen, tok):
    env = ToolEveryTurn(tok, turns=3)
    prompts = _prompts(tok, [env.reset(t) for t in TASKS])
    spy = Spy(gen)
    samples = multi_turn(spy, env, TASKS, prompts, max_turns=3, max_new_tokens=16, max_model_len=160, sampling=STOP)
    sep = tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    fed_to_sample = {tuple(p): out for prompts_, outs in spy.calls for p, out in zip(prompts_, outs)}
    for i, s in enumerate(samples):
        assert s.turns == 3 and s.finish_reason == "stop" and s.reward == 1.0
        expect, mask, engine_lp = list(prompts[i]), [], []
        for k in range(3):
            # The engine was fed exactly the previous tokens: a call with this very prompt exists.
            sampled = fed_to_sample[tuple(expect)]
            expect += sampled.completion_ids
            mask += [1] * len(sampled.completion_ids)
            engine_lp += sampled.behav_logprobs
            if k < 2:
                obs = env.observations[TASKS[i].question][k]
                assert set(sep) <= set(obs), "the template's turn separators are in the observation"
                expect += obs
                mask += [0] * len(obs)
        assert s.token_ids == expect  # token by token: prompt, reply, observation, reply, ...
        assert s.loss_mask == mask
        assert [x for x, m in zip(s.behav_logprobs, mask) if m] == engine_lp  # the engine's, unchanged
        assert all(x == 0.0 for x, m in zip(s.behav_logprobs, mask) if not m)
        assert all(v == -1 for v, m in zip(s.versions, mask) if not m)
        assert all(v == 0 for v, m in zip(s.versions, mask) if m)
    batch = RolloutBatch.from_samples(samples, advantages=[1.0, -1.0])
    for b, s in enumerate(samples):
        p = len(s.prompt_ids)
        assert batch.loss_mask[b, p:p + len(s.completion_ids)].tolist() == [float(m) for m in s.loss_mask]
        assert batch.loss_mask[b, :p].sum() == 0
    assert batch.num_loss_tokens == sum(sum(s.loss_mask) for s in samples) < sum(len(s.completion_ids) for s in samples)


def test_max_turns_and_context_cap_end_as_truncated(gen, tok):
    env = ToolEveryTurn(tok, turns=99)
    prompts = _prompts(tok, [env.reset(t) for t in TASKS])
    capped = multi_turn(gen, env, TASKS, prompts, max_turns=2, max_new_tokens=16, max_model_len=160,
                        truncated_score=-1.0, sampling=STOP)
    assert [(s.turns, s.finish_reason, s.reward, s.correct) for s in capped] == [(2, "length", -1.0, False)] * 2
    # A context cap that leaves room for the first reply and observation only.
    room = max(len(p) for p in prompts) + 16 + 40
    short = multi_turn(gen, env, TASKS, prompts, max_turns=10, max_new_tokens=16, max_model_len=room, sampling=STOP)
    for s in short:
        assert s.finish_reason == "length" and len(s.token_ids) < room and s.turns < 10


def test_calculator_answers_a_call_with_template_tokens(tok):
    env = get_environment("calculator", tokenizer=tok)
    state = env.reset(TASKS[0])
    call = tok.encode("Let me compute. <calc>12*7+3</calc>", add_special_tokens=False)
    step = env.step(state, call)
    assert not step.done and tok.decode(step.observation) == (
        "<|im_end|>\n<|im_start|>user\n<result>87</result><|im_end|>\n<|im_start|>assistant\n")
    done = env.step(state, tok.encode("So it is 87", add_special_tokens=False) + [tok.eos_token_id])
    assert done.done and done.reward == 1.0 and done.info["correct"]
    assert calculate("2 ** 10") == 1024 and calculate("7 / 2") == Fraction(7, 2)
    assert calculate("__import__('os')") is None and calculate("2 ** 10000") is None and calculate("1/0") is None


def test_multi_turn_batch_trains_and_the_next_rollouts_run_the_new_weights(gen, tok, tiny_llama_dir, tmp_path):
    """End to end: multi-turn rollouts -> a masked batch -> one Megatron step -> the weights pushed to
    the engine -> the next multi-turn rollouts run the new weights: the engine's logprobs of their reply
    tokens are the stepped trainer's (not only the version label), and the step moved them."""
    import math

    from megarl.algorithms.config import AlgorithmConfig
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.local import LocalTrainer

    # fp32 engine vs fp32 trainer on the same tokens: the probe's fp32 bound (1e-3 nats; measured < 1e-4,
    # megarl/controller/weight_sync.py's docstring). The control must clear it by 10x.
    FP32_GAP = 1e-3

    def gap(lp, batch) -> float:
        return float(((lp - batch.behav_logprobs).abs() * batch.loss_mask).max())

    env = ToolEveryTurn(tok, turns=2)
    prompts = _prompts(tok, [env.reset(t) for t in TASKS])
    samples = multi_turn(gen, env, TASKS, prompts, max_turns=2, max_new_tokens=16, max_model_len=160, sampling=STOP)
    assert all(s.turns == 2 and 0 in s.loss_mask for s in samples)
    batch = RolloutBatch.from_samples(samples, advantages=[1.0, -1.0])
    trainer = LocalTrainer(TrainerConfig(lr=1e-2, micro_batch_size=2), AlgorithmConfig(), tiny_llama_dir,
                           total_steps=1, run_dir=tmp_path)
    try:
        assert gap(trainer.logprobs(batch, temperature=1.0), batch) < FP32_GAP  # both start from the same weights
        metrics = trainer.step(batch)
        assert metrics and all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
        # control: the step moved the policy on the first rollouts' own reply tokens (else the check below is empty)
        assert gap(trainer.logprobs(batch, temperature=1.0), batch) > 10 * FP32_GAP
        gen.update_weights(trainer.hf_weights(), version=1)
        env = ToolEveryTurn(tok, turns=2)
        after = multi_turn(gen, env, TASKS, prompts, max_turns=2, max_new_tokens=16, max_model_len=160,
                           sampling=STOP)
        for s in after:
            assert {v for v, m in zip(s.versions, s.loss_mask) if m} == {1}
            assert {v for v, m in zip(s.versions, s.loss_mask) if not m} == {-1}
        after_batch = RolloutBatch.from_samples(after)
        assert gap(trainer.logprobs(after_batch, temperature=1.0), after_batch) < FP32_GAP  # the new weights ran
    finally:
        trainer.close()


class ConcurrentTool(ToolEveryTurn):
    """ToolEveryTurn whose steps say they may overlap; each step waits until every rollout of the turn is
    inside step, which only parallel steps can do (in order, the first wait would break the barrier)."""

    concurrent_steps = True

    def __init__(self, tokenizer, turns: int, parties: int):
        super().__init__(tokenizer, turns)
        self.barrier = threading.Barrier(parties, timeout=30)
        self.threads = set()

    def step(self, state, reply_ids):
        self.threads.add(threading.get_ident())
        self.barrier.wait()
        return super().step(state, reply_ids)


def test_a_turns_steps_run_in_parallel_when_the_environment_allows_it(gen, tok):
    env = ConcurrentTool(tok, turns=3, parties=len(TASKS))
    prompts = _prompts(tok, [env.reset(t) for t in TASKS])
    samples = multi_turn(gen, env, TASKS, prompts, max_turns=3, max_new_tokens=16, max_model_len=160, sampling=STOP)
    # every reply ends on a stop string (as in the first test), so each turn steps every rollout
    assert [(s.turns, s.finish_reason, s.reward) for s in samples] == [(3, "stop", 1.0)] * len(TASKS)
    assert threading.get_ident() not in env.threads and len(env.threads) >= len(TASKS)
    # an environment that does not say so is stepped one rollout at a time (tests/unit/test_env_steps.py
    # checks that no two of its steps overlap), off the caller's thread too: every step is bounded
    plain = ToolEveryTurn(tok, turns=2)
    seen = []
    step = plain.step
    plain.step = lambda state, ids: (seen.append(threading.get_ident()), step(state, ids))[1]
    multi_turn(gen, plain, TASKS, prompts, max_turns=2, max_new_tokens=16, max_model_len=160, sampling=STOP)
    assert len(seen) == 2 * len(TASKS) and threading.get_ident() not in seen  # 2 turns of steps
