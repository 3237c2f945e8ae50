"""Trainer checkpoints: model + optimizer + LR scheduler + RNG states + progress, saved atomically.

Layout of ``checkpoint_dir``::

    step_00000012/
        meta.json           progress, model signature, parallel layout, scheduler state, manifest,
                            and (when the caller passes it) the source HF config.json
        dist/               megatron dist_checkpointing: model (reshardable across TP/PP) + optimizer
        rng/rank_00000.pt   per-rank python / numpy / torch / cuda / megatron tracker RNG states
        hf_extra/           tokenizer / generation config / chat template of the source HF folder
                            (when the caller passes hf_extra_from): `megarl convert mcore-to-hf`
                            turns the step folder into a complete HF folder
        controller_state.json
                            the controller's part (data cursor, admitted rollouts), staged by the
                            controller in ``.stage_step_.../`` before the save and adopted by it
    latest                  name of the newest complete step folder (written last)

A save writes everything into ``.tmp_step_...``, adopts the staged files, writes ``meta.json`` last
(its manifest: every file with its size and CRC32; temp file + rename), fsyncs, renames the folder
into place and only then updates ``latest``; a crash at any point leaves the previous checkpoint
complete and ``latest`` pointing at it. "Complete" means ``meta.json`` is there and every file it
lists has its size and CRC32, the controller's state included, so there is no window in which
``latest`` names a step folder without it. At resume (:func:`resume_path`) a damaged newest
checkpoint is reported in one WARNING naming the file and the previous complete one is used.
A full disk is checked before writing (free space against the previous checkpoint's size) and
caught while writing (ENOSPC): the partial folder is removed, the previous checkpoint is left as it
was, and :class:`CheckpointNoSpace` names the path and the bytes needed. Model weights and optimizer
state reshard on load (another TP / PP / DP; :func:`load_checkpoint`); RNG states need the layout
they were saved with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megarl.trainer.checkpoint_index import checkpoint_root, resume_path, should_save  # noqa: F401
from megarl.trainer.async_save import AsyncWriter
from megarl.utils.faults import injected
from megarl.trainer.checkpoint_files import copy_hf_extra, known_shard_crcs, record_shard_crcs
# The checkpoint folder's names, index, atomic writes, staging and pruning: the store (one owner).
from megarl.utils.checkpoint_store import (FORMAT, LATEST, META, STAGE_PREFIX, STEP_PREFIX, TRASH_PREFIX,  # noqa: F401
                                           CheckpointError, CheckpointNoSpace, checkpoint_problem, file_crc32,
                                           latest_checkpoint, list_checkpoints, newest_complete, prune,
                                           resolve_checkpoint, stage_dir, stage_file, step_dir_name, tmp_dir,
                                           write_text_atomic)
from megarl.utils.checkpoint_store import fsync_dir as _fsync_dir, fsync_tree as _fsync_tree  # noqa: F401
from megarl.utils.checkpoint_store import manifest as _manifest, no_space as _no_space, tree_bytes as _tree_bytes
from megarl.trainer.lora_base import check_lora, lora_meta
from megarl.trainer.model import unwrap

log = logging.getLogger(__name__)

_SPACE_MARGIN = 1.10  # a save needs this much more than the previous checkpoint's size (ratio)
EXTRA_DIR = "hf_extra"  # the source HF folder's tokenizer files, in step folders and model checkpoints
# The DistributedOptimizer's state in model space (a tensor per parameter, like a plain optimizer's):
# it reshards at load to any TP / PP / DP. megatron-core 0.16.1 builds it by all-gathering the state
# of each model-parallel shard within its DP group at save (its "fully_reshardable"; its
# "fully_sharded_model_space", which would not gather, fails there: "ShardedTensor.flattened_range is
# not supported"); every rank then writes its own part. Checkpoints from before meta.json recorded it
# used "dp_reshardable" (same layout only).
OPTIM_SHARDING = "fully_reshardable"
_OLD_OPTIM_SHARDING = "dp_reshardable"
_RESHARDABLE = ("fully_sharded_model_space", "fully_reshardable")


@dataclasses.dataclass
class TrainProgress:
    """Where training stands; saved with every checkpoint and returned by load_checkpoint."""
    step: int = 0
    consumed_samples: int = 0
    extra: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- model identity

def model_signature(model: torch.nn.Module) -> dict:
    """What must match between a checkpoint and the model it loads into (parallel-size free)."""
    m = unwrap(model)
    c = m.config
    sig = {k: getattr(c, k) for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm")}
    sig["params_dtype"] = str(c.params_dtype).replace("torch.", "")
    sig["tied_embeddings"] = bool(getattr(m, "share_embeddings_and_output_weights", False))
    dims = getattr(m, "megarl_dims", None)
    if dims is not None:  # the HF-derived facts, including the unpadded vocab
        sig.update({f"hf.{k}": v for k, v in dims.as_json().items()})
    else:
        sig["vocab_size"] = int(m.vocab_size)
    return sig


@contextlib.contextmanager
def _keep_torch_adam_step(optimizer: Any):
    """megatron-core 0.16.1's DistributedOptimizer, loading "fully_reshardable" state without Apex/TE
    (torch Adam): its load_state_dict gives each param's state a ``step`` that the checkpoint's
    per-param tensors lack, and ``_set_main_param_and_optimizer_states`` then copies every key of the
    state from them (KeyError 'step'). Here the state's own ``step`` stands in for the missing one (a
    copy onto itself); :func:`_restore_adam_steps` sets the real count after the load."""
    patched = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        setter = getattr(sub, "_set_main_param_and_optimizer_states", None)
        if setter is None or sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue

        def with_step(model_param, tensors, _sub=sub, _setter=setter):
            group, order = _sub.model_param_group_index_map[model_param]
            state = _sub.optimizer.state[_sub.optimizer.param_groups[group]["params"][order]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return _setter(model_param, tensors)

        sub._set_main_param_and_optimizer_states = with_step
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states  # back to the class's method


def _is_distributed(optimizer: Any) -> bool:
    """Whether megatron's DistributedOptimizer holds (part of) the state: only its sharding type
    depends on the layout; the plain optimizers' state maps onto the model's sharded tensors."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(type(sub).__name__ == "DistributedOptimizer" for sub in subs)


def _parallel_layout() -> dict:
    from megatron.core import parallel_state as ps
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "world": dist.get_world_size()}


# ----------------------------------------------------------------------------- RNG

def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        get_cuda_rng_tracker().set_states(state["tracker"])


# ----------------------------------------------------------------------------- optimizer helpers

def _inner_torch_optimizers(optimizer: Any) -> list:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [getattr(o, "optimizer", o) for o in subs]


def _adam_steps(optimizer: Any) -> Optional[int]:
    """The per-parameter Adam step count (torch Adam keeps one per param); None before a step."""
    steps = {int(s["step"]) for o in _inner_torch_optimizers(optimizer)
             for s in o.state.values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"optimizer params disagree on the Adam step count: {sorted(steps)}")
    return steps.pop() if steps else None


def _restore_adam_steps(optimizer: Any, step: Optional[int]) -> None:
    """Torch Adam's bias correction reads each param's own `step`: set every one, or a resumed run
    silently diverges from an uninterrupted one."""
    if step is None:
        return
    for o in _inner_torch_optimizers(optimizer):
        for s in o.state.values():
            if s:  # megatron's load path creates exp_avg/exp_avg_sq without a `step`
                s["step"] = torch.tensor(float(step), dtype=torch.float32)
    got = _adam_steps(optimizer)
    if got != step or any(s and "step" not in s for o in _inner_torch_optimizers(optimizer)
                          for s in o.state.values()):
        raise CheckpointError(f"restoring the Adam step count failed: wanted {step}, have {got}")


def _sharded_state(model_chunks: list, optimizer: Any, is_loading: bool, optim_sharding: str = OPTIM_SHARDING,
                   saved_keys: set | None = None) -> dict:
    """The model's (and optimizer's) sharded state, every parameter under its TE-spec key (spec_keys.py:
    a checkpoint moves between the TE and the local spec); ``saved_keys``: the checkpoint's, when loading."""
    from megarl.trainer.spec_keys import te_keys

    meta = {"distrib_optim_sharding_type": optim_sharding, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}
    if len(model_chunks) != 1:
        raise CheckpointError("checkpointing supports one model chunk per rank (no virtual PP)")
    model_sd = unwrap(model_chunks[0]).sharded_state_dict(metadata=meta)
    te_keys(model_chunks[0], model_sd, saved_keys)
    out = {"model": model_sd}
    if optimizer is not None:
        out["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                        metadata=meta)
    return out


def use_in_process_write_queue() -> None:
    """Our saves are synchronous: megatron's writer then runs in this process and only needs an
    in-process queue for its results. Its default is a multiprocessing Manager server per rank,
    which outlives a rank that is killed and leaks one process per crash."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def _barrier(what: str) -> None:
    log.debug("checkpoint: barrier (%s)", what)
    dist.barrier()


# ----------------------------------------------------------------------------- save

def _space_needed(root: Path, model: list, optimizer: Any) -> int:
    """Bytes a save will take: the newest checkpoint's size, or (first save) an estimate from the
    parameters (weights + fp32 Adam moments, times the model-parallel ranks), with a margin."""
    prev = list_checkpoints(root)
    if prev:
        try:
            meta = json.loads((prev[-1] / META).read_text())
            return int(_SPACE_MARGIN * (sum(meta["files"].values()) + (prev[-1] / META).stat().st_size))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    per_param = 8 if optimizer is not None else 0  # exp_avg + exp_avg_sq in fp32
    local = sum(p.numel() * (p.element_size() + per_param) for p in model[0].parameters())
    layout = _parallel_layout()
    return int(_SPACE_MARGIN * local * layout["tp"] * layout["pp"])


def _free_bytes(root: Path) -> int:
    """Free bytes at ``root`` before a save (tests replace it to reach the write-time check; fault
    injection ``disk_free_bytes=N``, megarl/utils/faults.py, makes a rank see N)."""
    faked = injected("disk_free_bytes")
    return int(faked) if faked else shutil.disk_usage(root).free


def _agree(problem: Optional[str]) -> Optional[str]:
    """Every rank learns the first rank's problem (None: no rank has one); a collective."""
    if dist.get_world_size() == 1:
        return problem
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return next((p for p in found if p is not None), None)


def save_checkpoint(checkpoint_dir: str | Path, *, model: list, optimizer: Any = None,
                    scheduler: Any = None, progress: TrainProgress, keep_last: int = 2,
                    hf_config: Optional[dict] = None, hf_extra_from: str | Path | None = None,
                    writer: Optional[AsyncWriter] = None,
                    _before_commit: Optional[Callable[[Path], None]] = None) -> Path:
    """Save a checkpoint of this step; collective over every trainer rank.

    Returns the step folder. Files staged for this step (:func:`stage_file`) move into it before
    the manifest is written. `hf_config` (the source HF config.json as a dict) and `hf_extra_from`
    (the HF folder the model came from: its tokenizer / generation config files are copied into
    `hf_extra/`) are export metadata only: with them `megarl convert mcore-to-hf` writes a
    complete HF folder from the step folder; loading ignores them. `writer` (trainer.async_save):
    first wait for its write in flight (logged), then take this step's snapshot (RNG, scheduler,
    progress and the shards' plan now) and return while it writes the shards; the commit below runs
    when it is done (:mod:`megarl.trainer.async_save`), and the returned folder exists only then.
    `_before_commit` (tests only) runs after all files are written and before the rename, to
    simulate a crash mid-save. A full disk (checked before writing, or hit while writing) removes
    the partial folder, leaves the previous checkpoint as it was and raises
    :class:`CheckpointNoSpace` on every rank.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1 (trainer.keep_checkpoints)")
    from megatron.core import dist_checkpointing

    # This step's progress, taken now: the caller's object moves on while an async write is in flight
    # (the commit below runs steps later; with the live value it adopted a later step's staged state).
    step, consumed, extra = progress.step, progress.consumed_samples, dict(progress.extra)
    snapshot_at = time.time()  # a stage newer than this is the next save's (prune)
    if writer is not None:
        writer.wait(f"saving step {step}")  # one write in flight: the previous one commits first
    root = Path(checkpoint_dir)
    name = step_dir_name(step)
    final, tmp = root / name, tmp_dir(root, step)
    rank = dist.get_rank()
    t0 = time.monotonic()
    need, free, problem = 0, 0, None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crashed save
            shutil.rmtree(tmp)
        need, free = _space_needed(root, model, optimizer), _free_bytes(root)
        if need > free:  # refused before writing a byte; the staged controller state goes too
            problem = (need, free)
            shutil.rmtree(stage_dir(root, step), ignore_errors=True)
            log.error("checkpoint: step %d: %d bytes needed at %s, %d free", step, need, root, free)
        else:
            (tmp / "dist").mkdir(parents=True)
            (tmp / "rng").mkdir()
    problem = _agree(problem)  # also the barrier: the temp dir exists
    if problem:
        raise CheckpointNoSpace(root, problem[0], problem[1], step)

    def no_space(e: BaseException) -> Optional[str]:
        """Why the disk is full, or re-raise ``e``. Some writers lose the errno (torch's zip writer
        reports 'unexpected pos'), so a failure that left less free space than the rest of the save
        needs counts as a full disk too."""
        if not _no_space(e):
            try:
                left = shutil.disk_usage(root).free
                remaining = (need or _space_needed(root, model, optimizer)) - _tree_bytes(tmp)
            except OSError:
                raise e from None
            if left >= remaining:
                raise e
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"

    # What the step's checkpoint records, taken now: an async write commits it steps later.
    meta = {"format": FORMAT, "step": step, "consumed_samples": consumed,
            "extra": extra, "model": model_signature(model[0]), "parallel": _parallel_layout(),
            "has_optimizer": optimizer is not None, "optim_sharding": OPTIM_SHARDING,
            "adam_step": _adam_steps(optimizer) if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "async_save": writer is not None}
    lora = lora_meta(model[0], hf_extra_from)
    if lora is not None:  # the adapters' rank, alpha, targets and the base they train on (path + content hash)
        meta["lora"] = lora
    if hf_config is not None or hf_extra_from is not None:  # export metadata (optional)
        m0 = unwrap(model[0])
        meta["export"] = {"hf_config": hf_config, "hf_source": str(hf_extra_from) if hf_extra_from is not None else None,
                          "vocab_divisible_by": getattr(m0, "megarl_vocab_divisible_by", None),
                          "norm_style": getattr(m0, "megarl_norm_style", None)}
    written, request = None, None
    try:
        torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        if writer is None:
            use_in_process_write_queue()
            dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(tmp / "dist"))
        else:
            from megatron.core.dist_checkpointing.strategies import filesystem_async

            filesystem_async._results_queue = writer.results_queue()  # the forked writer reports here
            request = dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False),
                                              str(tmp / "dist"), async_sharded_save=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch DCP's CheckpointException is a BaseException;
        written = no_space(e)   # only a full disk is handled, anything else re-raises

    def commit(failed: Optional[BaseException]) -> Path:
        """The shards are written (``failed``: how their write failed, the same on every rank):
        adopt the staged files, write the manifest last, rename, move `latest`; collective."""
        written_ = _agree(no_space(failed) if failed is not None else written)  # the shards are written
        if rank == 0 and not written_:
            try:
                stage = stage_dir(root, step)
                if stage.is_dir():  # the controller's part, staged before this save
                    for f in sorted(stage.iterdir()):
                        os.replace(f, tmp / f.name)
                if hf_extra_from is not None:
                    copy_hf_extra(hf_extra_from, tmp / EXTRA_DIR)
                files, crcs = _manifest(tmp, known_shard_crcs(tmp))  # an async writer CRCed its own shards
                _fsync_tree(tmp)
                write_text_atomic(tmp / META, json.dumps({**meta, "saved_at": time.time(), "files": files,
                                                          "crc32": crcs}, indent=1, default=str))  # the manifest: last
            except OSError as e:
                written_ = no_space(e)
        written_ = _agree(written_ if rank == 0 else None)  # metadata written
        if written_:
            free_ = free
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(stage_dir(root, step), ignore_errors=True)
                free_ = shutil.disk_usage(root).free
                log.error("checkpoint: saving step %d to %s failed: %s", step, root, written_)
            raise CheckpointNoSpace(root, need or _space_needed(root, model, optimizer), free_, step)
        if _before_commit is not None:
            _before_commit(tmp)
        if rank == 0:
            if final.exists():  # re-saving a step: replace it
                trash = root / f"{TRASH_PREFIX}{name}"
                os.replace(final, trash)
                shutil.rmtree(trash)
            os.replace(tmp, final)
            _fsync_dir(root)
            write_text_atomic(root / LATEST, name)  # last: `latest` only ever names a complete one
            prune(root, final, keep_last, later_stages_since=snapshot_at if writer is not None else None)
            log.info("checkpoint: saved step %d to %s in %.1fs (%.1f MiB)", step, final,
                     time.monotonic() - t0, _tree_bytes(final) / 2**20)
        _barrier("checkpoint committed")
        return final

    if writer is None or _agree(written) is not None:
        return commit(None)
    writer.start(request, commit, step, after_write=lambda: record_shard_crcs(tmp, rank))
    return final


# ----------------------------------------------------------------------------- load

def check_checkpoint(path: str | Path, *, model_signature_now: Optional[dict] = None,
                     tp: Optional[int] = None, pp: Optional[int] = None) -> dict:
    """Validate a checkpoint without loading tensors; return its metadata.

    Raises CheckpointError naming the problem: not a checkpoint, a missing or truncated file,
    a model that differs from model_signature_now, or a tp/pp the saved model cannot split into.
    """
    step_dir = resolve_checkpoint(path)
    try:
        meta = json.loads((step_dir / "meta.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{step_dir / 'meta.json'} is corrupt ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{step_dir} has format {meta.get('format')!r}; expected {FORMAT!r}")
    for rel, size in meta["files"].items():
        f = step_dir / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {step_dir} is incomplete: missing file {rel}")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {step_dir} is damaged: {rel} has "
                                  f"{f.stat().st_size} bytes, expected {size}")
    saved = meta["model"]
    heads, groups = saved["num_attention_heads"], saved["num_query_groups"] or saved[
        "num_attention_heads"]
    if tp is not None and (heads % tp or groups % tp):
        raise CheckpointError(f"tp={tp} cannot split the checkpoint's model: it has "
                              f"num_attention_heads={heads} and num_query_groups={groups}; use a "
                              f"tp that divides both")
    if pp is not None and saved["num_layers"] % pp:
        raise CheckpointError(f"pp={pp} does not divide the checkpoint's num_layers="
                              f"{saved['num_layers']}")
    if model_signature_now is not None:
        # a key a checkpoint from before it existed lacks matches its off value (qk_layernorm False, ...)
        diff = {k: (saved.get(k), model_signature_now.get(k))
                for k in sorted(set(saved) | set(model_signature_now))
                if saved.get(k) != model_signature_now.get(k)
                and not (k not in saved and model_signature_now.get(k) in (False, (), [], None))}
        if diff:
            lines = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in diff.items())
            raise CheckpointError(f"checkpoint {step_dir} was saved from a different model "
                                  f"({lines}); load it into a model built from the same config")
    return meta


def load_checkpoint(path: str | Path, *, model: list, optimizer: Any = None, scheduler: Any = None,
                    load_rng: bool = True) -> TrainProgress:
    """Load a checkpoint into already-built model chunks (and optimizer / scheduler); collective.

    Model weights and optimizer state (Adam moments, fp32 master weights, step counts) load at any
    TP / PP / DP that splits the model: megatron's dist_checkpointing reshards them, and the log says
    so ("resharded from tp1 pp1 dp2 to tp2 pp1 dp1"). Checkpoints written before the optimizer was
    saved in model space ("dp_reshardable") resume their optimizer at their own layout only. RNG
    states are restored only at the same layout (each rank's stream belongs to its coordinates).
    Pass optimizer=None, load_rng=False to load weights only.
    """
    from megatron.core import dist_checkpointing

    layout = _parallel_layout()
    meta = check_checkpoint(path, model_signature_now=model_signature(model[0]),
                            tp=layout["tp"], pp=layout["pp"])
    step_dir = resolve_checkpoint(path)
    check_lora(meta, model[0], step_dir)
    saved_layout = meta["parallel"]
    same_layout = all(saved_layout[k] == layout[k] for k in ("tp", "pp", "dp"))
    describe = lambda l: f"tp{l['tp']} pp{l['pp']} dp{l['dp']}"  # noqa: E731
    optim_sharding = meta.get("optim_sharding", _OLD_OPTIM_SHARDING)
    if optimizer is not None:
        if not meta["has_optimizer"]:
            raise CheckpointError(f"{step_dir} has no optimizer state; start from its weights only "
                                  f"(trainer.resume_optimizer=false; in Python: optimizer=None)")
        if not same_layout and optim_sharding not in _RESHARDABLE and _is_distributed(optimizer):
            raise CheckpointError(
                f"{step_dir} holds optimizer state for tp={saved_layout['tp']} pp="
                f"{saved_layout['pp']} dp={saved_layout['dp']} in the old per-layout format "
                f"({optim_sharding}), this job is tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}; "
                f"convert it by resuming once at the saved layout (trainer.tp={saved_layout['tp']} "
                f"trainer.pp={saved_layout['pp']} trainer.dp={saved_layout['dp']}; every checkpoint that run "
                f"writes reshards), or start from its weights only (trainer.resume_optimizer=false)")
        if meta["adam_step"] is not None and _adam_steps(optimizer) is None:
            # empty torch-Adam state: create it so the sharded load has tensors to fill
            for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
                if hasattr(sub, "_init_optimizer_states_with_dummy_values"):  # DistributedOptimizer
                    sub._init_optimizer_states_with_dummy_values()
    t0 = time.monotonic()
    saved_keys = set(dist_checkpointing.load_tensors_metadata(str(step_dir / "dist")))
    sharded = _sharded_state(model, optimizer, is_loading=True, optim_sharding=optim_sharding,
                             saved_keys=saved_keys)
    loaded = dist_checkpointing.load(sharded, str(step_dir / "dist"))
    if not same_layout:
        log.info("checkpoint: resharded %s from %s to %s", "model and optimizer" if optimizer is not None
                 else "model", describe(saved_layout), describe(layout))
    with torch.no_grad():  # fp32 DistributedOptimizer shards are views of the model params
        unwrap(model[0]).load_state_dict(loaded["model"], strict=True)
        if optimizer is not None:
            with _keep_torch_adam_step(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer, meta["adam_step"])
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if load_rng:
        rng_file = step_dir / "rng" / f"rank_{dist.get_rank():05d}.pt"
        if not same_layout or saved_layout["world"] != layout["world"]:
            log.warning("checkpoint: layout changed (%s -> %s): RNG states not restored",
                        saved_layout, layout)
        else:
            _set_rng_state(torch.load(rng_file, weights_only=False))
    _barrier("checkpoint loaded")
    log.info("checkpoint: loaded step %d from %s in %.1fs", meta["step"], step_dir,
             time.monotonic() - t0)
    return TrainProgress(step=meta["step"], consumed_samples=meta["consumed_samples"],
                         extra=meta.get("extra") or {})
