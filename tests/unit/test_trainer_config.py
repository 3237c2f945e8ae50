"""TrainerConfig: every knob documented, section-local problems name the key."""

from __future__ import annotations

import dataclasses

from megarl.trainer.config import TrainerConfig


def test_every_knob_has_help_with_its_default():
    for f in dataclasses.fields(TrainerConfig):
        help_text = f.metadata.get("help", "")
        assert help_text and "Default" in help_text, f"trainer.{f.name} lacks help/default"


def test_defaults_are_valid_and_bad_values_name_the_key():
    assert TrainerConfig().problems() == []
    bad = TrainerConfig(tp=0, micro_batch_size=0, lr=1e-5, min_lr=1e-4, adam_beta2=1.0,
                        lr_warmup_steps=-1, logprob_temperature=0.0, keep_checkpoints=0)
    msgs = bad.problems()
    for key in ("trainer.tp=0", "trainer.micro_batch_size=0", "trainer.min_lr=0.0001",
                "trainer.adam_beta1/2", "trainer.lr_warmup_steps=-1",
                "trainer.logprob_temperature=0.0", "trainer.keep_checkpoints=0"):
        assert any(key in m for m in msgs), (key, msgs)


def test_scheduler_rejects_decay_shorter_than_warmup():
    import pytest

    from megarl.trainer.optimizer import build_scheduler

    cfg = TrainerConfig(lr_warmup_steps=10, lr_decay_steps=5, lr_decay_style="cosine")
    with pytest.raises(ValueError, match="lr_decay_steps=5 must exceed trainer.lr_warmup_steps=10"):
        build_scheduler(cfg, optimizer=None, total_steps=100)
