"""The critic's clipped value loss (megarl/critic/value_loss.py) against hand values. Pure math."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.critic.value_loss import value_loss

MASK = torch.tensor([[1, 1, 0]], dtype=torch.bool)
OLD = torch.tensor([[0.5, 2.5, 0.0]], dtype=torch.float64)
TARGETS = torch.tensor([[2.0, 2.0, 5.0]], dtype=torch.float64)


def test_clipped_value_loss_hand_values_and_gradient():
    values = torch.tensor([[1.0, 2.0, 9.0]], dtype=torch.float64, requires_grad=True)
    loss, m = value_loss(values, OLD, TARGETS, MASK, value_clip=0.2)
    # token 0: (1-2)^2 = 1 vs (0.5+0.2-2)^2 = 1.69;  token 1: 0 vs (2.5-0.2-2)^2 = 0.09;  token 2 masked
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09) / 2, abs=1e-12)
    assert m["critic/value_loss"] == pytest.approx(0.445, abs=1e-12) and m["critic/clip_frac"] == 1.0
    assert math.isnan(m["critic/explained_var"])  # the two targets are equal: nothing to explain
    loss.backward()
    assert values.grad.tolist() == [[0.0, 0.0, 0.0]]  # both moved past the clip: the clipped branch is flat
    # without the clip: the plain squared error, and its gradient (v - G) / tokens
    values.grad = None
    loss, m = value_loss(values, OLD, TARGETS, MASK, value_clip=None)
    assert loss.item() == pytest.approx(0.25, abs=1e-12) and m["critic/clip_frac"] == 0.0
    loss.backward()
    assert values.grad.tolist() == [[-0.5, 0.0, 0.0]]


def test_inside_the_clip_the_gradient_is_the_squared_errors():
    values = torch.tensor([[0.6, 2.45, 0.0]], dtype=torch.float64, requires_grad=True)
    loss, m = value_loss(values, OLD, TARGETS, MASK, value_clip=0.2, denominator=4)
    # both within 0.2 of OLD: clipped == unclipped; 0.5 * (1.4^2 + 0.45^2) / 4 (the minibatch's 4 tokens)
    assert loss.item() == pytest.approx(0.5 * (1.96 + 0.2025) / 4, abs=1e-12)
    assert m["critic/clip_frac"] == 0.0
    loss.backward()
    assert values.grad[0, :2].tolist() == pytest.approx([-1.4 / 4, 0.45 / 4], abs=1e-12)


def test_refusals():
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        value_loss(OLD, OLD, TARGETS, MASK, value_clip=0.0)
    with pytest.raises(ValueError, match="targets must be"):
        value_loss(OLD, OLD, TARGETS[:, :2], MASK)
