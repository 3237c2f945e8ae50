"""`megarl plan-sync`: numbers against hand computations on a tiny config, DP balance, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# hidden 64, 4 heads of 16 (2 KV heads), ffn 128, vocab 256 (no padding at TP 1/2), 2 layers, untied.
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}
# Hand count: embed 256*64 + lm_head 256*64 + final norm 64
# + per layer: 2 norms 2*64, q 64*64, k 32*64, v 32*64, o 64*64, gate/up/down 3 * 128*64.
PER_LAYER = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64
PARAMS = 2 * 256 * 64 + 64 + 2 * PER_LAYER
LARGEST_TENSOR = 256 * 64  # the embedding / lm_head


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl", "plan-sync", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def plan(tmp_path: Path, model: Path, trainer: str, generator: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"{trainer}-{generator}-{'-'.join(extra)}.json"
    proc = run("--model", str(model), "--trainer", trainer, "--generator", generator, "--json", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_single_rank_to_single_worker_matches_hand_count(tiny, tmp_path):
    r, text = plan(tmp_path, tiny, "1x1x1", "1x1")
    model_bytes = PARAMS * 2
    assert r["model_params"] == PARAMS and r["model_bytes"] == model_bytes
    assert r["total_bytes"] == model_bytes
    assert r["bytes_sent_per_trainer_rank"] == {"min": model_bytes, "median": model_bytes, "max": model_bytes}
    assert r["bytes_received_per_generator_worker"]["max"] == model_bytes
    assert r["messages"] == 1
    assert r["busiest_link_bytes"] == model_bytes
    assert r["projected_sync_s"] == pytest.approx(model_bytes * 8 / 400e9)
    b = r["baseline"]
    assert (b["rank0_shard_bytes"], b["gather_bytes"], b["broadcast_bytes"]) == (model_bytes, 0, model_bytes)
    assert b["sync_s"] == pytest.approx(model_bytes * 8 / 400e9)
    for line in ("total bytes moved", "sent per trainer rank", "recv per gen. worker", "messages",
                 "busiest link", "projected sync (DDMA)", "baseline (rank 0)"):
        assert line in text


def test_baseline_and_link_speed_by_hand(tiny, tmp_path):
    # Trainer TP2 (rank 0 holds half of every split tensor + all norms), 2 generator workers x 2 replicas.
    r, _ = plan(tmp_path, tiny, "2x1x1", "2x2", "--link-gbps", "100")
    model_bytes = PARAMS * 2
    norms = 2 * 2 * 64 + 64
    rank0 = ((PARAMS - norms) // 2 + norms) * 2
    b = r["baseline"]
    assert b["rank0_shard_bytes"] == rank0
    assert b["gather_bytes"] == model_bytes - rank0
    assert b["broadcast_bytes"] == r["total_bytes"] == 2 * (model_bytes + norms * 2)  # norms replicated over TP
    assert b["sync_s"] == pytest.approx((model_bytes - rank0 + b["broadcast_bytes"]) * 8 / 100e9)
    assert r["projected_sync_s"] == pytest.approx(r["busiest_link_bytes"] * 8 / 100e9)
    assert r["busiest_link_bytes"] == max(r["bytes_sent_per_trainer_rank"]["max"],
                                          r["bytes_received_per_generator_worker"]["max"])


def test_dp2_halves_busiest_sender_and_fp8_halves_bytes(tiny, tmp_path):
    dp1, _ = plan(tmp_path, tiny, "1x1x1", "1x2")
    dp2, _ = plan(tmp_path, tiny, "1x1x2", "1x2")
    s1, s2 = dp1["bytes_sent_per_trainer_rank"]["max"], dp2["bytes_sent_per_trainer_rank"]["max"]
    assert s1 == 2 * PARAMS * 2 and dp2["total_bytes"] == dp1["total_bytes"]
    assert abs(s2 - s1 / 2) <= LARGEST_TENSOR * 2
    fp8, text = plan(tmp_path, tiny, "1x1x2", "1x2", "--dtype", "fp8")
    assert fp8["total_bytes"] * 2 == dp2["total_bytes"] and fp8["bytes_per_element"] == 1
    assert fp8["busiest_link_bytes"] * 2 == dp2["busiest_link_bytes"]
    assert "fp8 scales ignored" in text


def test_model_folder_is_accepted(tiny, tmp_path):
    r, _ = plan(tmp_path, tiny.parent, "1x1x1", "1x1")
    assert r["model_params"] == PARAMS


def test_llama_8b_projection():
    # its speed is measured by megarl/bench/fast_paths.py (no wall-clock bound in a test)
    proc = run("--model", "configs/models/llama-3.1-8b.json", "--trainer", "2x1x2", "--generator", "2x2")
    assert proc.returncode == 0, proc.stderr
    assert "projected sync (DDMA)" in proc.stdout and "8,030,261,248 params" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (("--trainer", "2x1", "--generator", "1x1"), "TPxPPxDP"),
    (("--trainer", "2xax1", "--generator", "1x1"), "TPxPPxDP"),
    (("--trainer", "1x1x1", "--generator", "0x1"), "TPxREPLICAS"),
    (("--trainer", "3x1x1", "--generator", "1x1"), "num_attention_heads"),
    (("--trainer", "1x3x1", "--generator", "1x1"), "num_hidden_layers"),
    (("--trainer", "1x1x1", "--generator", "3x1"), "num_attention_heads"),
    (("--trainer", "1x1x1", "--generator", "1x1", "--link-gbps", "0"), "link-gbps"),
])
def test_bad_input_is_one_line_exit_2(tiny, args, needle):
    proc = run("--model", str(tiny), *args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("megarl plan-sync:")


def test_missing_and_bad_model_files(tmp_path):
    for path, needle in ((tmp_path / "nope.json", "no such file"), (tmp_path, "no config.json")):
        proc = run("--model", str(path), "--trainer", "1x1x1", "--generator", "1x1")
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    proc = run("--model", str(bad), "--trainer", "1x1x1", "--generator", "1x1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "lacks" in proc.stderr
