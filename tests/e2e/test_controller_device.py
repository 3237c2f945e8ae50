"""cluster.device is read by the controller: 'cpu' hides CUDA from the job, 'cuda' insists on it."""

from __future__ import annotations

import os

import pytest
import torch

from megarl.config import ConfigError
from megarl.controller.startup import select_device as _select_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_a_device_is_a_config_error():
    with pytest.raises(ConfigError, match="cluster.device=cuda"):
        _select_device("cuda")


def test_cpu_hides_cuda_from_the_job(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if torch.cuda.is_available():  # torch already saw the device: the controller says so
        with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
            _select_device("cpu")
    else:
        _select_device("cpu")
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # engines spawned from here inherit it


def test_auto_changes_nothing(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _select_device("auto")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
