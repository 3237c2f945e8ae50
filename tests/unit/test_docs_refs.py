"""README.md and docs/*.md in step with the code, read statically (no torch, a second or two):

- every ``section.knob`` written in inline code is a knob of the config schema (megarl/config/schema.py
  and the per-role config.py files it composes);
- every repository path written in inline code (``megarl/...``, ``tools/...``, ``configs/...``, ``docs/...``,
  ``tests/...``, ``csrc/...``, ``launch/...``) exists (globs, ``{a,b}`` and ``<placeholder>`` allowed);
- docs/loop.md's metrics table names only metrics megarl emits, and every metric of a training step's
  row (the step-metrics paths below) is in it; the policy loss's own metrics (``train/loss/<name>``)
  are in docs/algorithms.md's table.

Each failure names the doc's file:line (or, for an undocumented metric, the code's).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")  # CommonMark: closed by a run of the same length
FENCE = re.compile(r"^\s*(```|~~~)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.lru_cache(maxsize=None)
def _inline_code(path: Path) -> tuple[tuple[int, str], ...]:
    """(line number, content) of every inline code span of ``path``, fenced blocks left out."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out += [(number, m.group(2).strip()) for m in INLINE.finditer(line)]
    return tuple(out)


# --- a. config knobs -------------------------------------------------------------------------------------

# `section.name` spans that are not config knobs, each with why (a real section's name, read as prose)
NOT_KNOBS = {
    "trainer.step": "the Trainer protocol's method (docs/algorithms.md: the critic's order in a step)",
    "critic.step": "the critic executor's method (docs/algorithms.md)",
    "model.load_weights": "vLLM's model method (docs/generator.md)",
    "sync.model_parallel": "a key of a simulator setup (configs/sim/*.yaml), not of the train config",
}
# `sync.py`, `model.safetensors`, `controller.log`: file names, not knobs
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "yml", "md", "png", "log", "txt", "safetensors", "sbatch", "sh", "pt"}


@functools.lru_cache(maxsize=None)
def config_schema() -> dict[str, set[str]]:
    """{section: its knob (and sub-section) names} from the dataclasses MegaRLConfig composes."""
    from megarl.config.schema import MegaRLConfig

    def section_type(f: dataclasses.Field):
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            return type(value) if dataclasses.is_dataclass(value) else None
        return type(f.default) if dataclasses.is_dataclass(f.default) else None

    out: dict[str, set[str]] = {}
    for f in dataclasses.fields(MegaRLConfig):
        cls = section_type(f)
        if cls is not None:
            out[f.name] = {g.name for g in dataclasses.fields(cls)}
    return out


def knob_problems() -> list[str]:
    schema = config_schema()
    # a real section, not after '.', '/', '-' or a letter (a module or file path), not a call, not a deeper
    # dotted name (`model.embed_tokens.weight`: an HF parameter; the config has two levels)
    key = re.compile(r"(?<![\w./-])(" + "|".join(sorted(schema)) + r")\.([A-Za-z_]\w*)(\*?)(?![\w(*]|\.\S)")
    out = []
    for doc in DOCS:
        for number, span in _inline_code(doc):
            for m in key.finditer(span):
                section, name, star = m.groups()
                full = f"{section}.{name}"
                if full in NOT_KNOBS or name in FILE_SUFFIXES:
                    continue
                if star and any(k.startswith(name) for k in schema[section]):
                    continue  # `trainer.lora_*`: a family of knobs
                if name not in schema[section]:
                    near = difflib.get_close_matches(name, schema[section], n=1)
                    hint = f"; did you mean {section}.{near[0]}?" if near else ""
                    out.append(f"{_rel(doc)}:{number}: `{span}` names {full}{star}, which is no knob of the config "
                               f"schema (megarl/config/schema.py){hint}")
    return out


def test_knobs_in_docs_exist_in_the_config_schema():
    assert len(config_schema()) >= 10, "the schema's sections were not found: the test reads nothing"
    problems = knob_problems()
    assert not problems, "\n".join(problems)


# --- b. repository paths ---------------------------------------------------------------------------------

PLACEHOLDER_PATHS = {"configs/my.yaml"}  # docs/slurm.md: "your config"
PATH = re.compile(r"(?<![\w./-])((?:megarl|tools|configs|docs|tests|csrc|launch)/[\w./*{},<>-]*)")


def _expand(path: str) -> list[str]:
    """``docs/x.{json,png}`` -> both."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def path_problems() -> list[str]:
    out = []
    for doc in DOCS:
        for number, span in _inline_code(doc):
            for m in PATH.finditer(span):
                path = m.group(1).split("::")[0].rstrip(".,:;")
                if path in PLACEHOLDER_PATHS:
                    continue
                for p in _expand(path):
                    pattern = re.sub(r"<[^>]*>", "*", p)  # `configs/sim/llamarl_<size>.yaml`
                    found = (glob.glob(str(ROOT / pattern)) if any(c in pattern for c in "*?[")
                             else (ROOT / pattern).exists())
                    if not found:
                        out.append(f"{_rel(doc)}:{number}: `{span}` names {p}, which does not exist")
    return out


def test_paths_in_docs_exist():
    problems = path_problems()
    assert not problems, "\n".join(problems)


# --- c. metrics ------------------------------------------------------------------------------------------

METRICS_DOC = ROOT / "docs" / "loop.md"
TABLE_HEADER = re.compile(r"^\|\s*metric\s*\|\s*unit\s*\|\s*meaning\s*\|\s*computed in\s*\|")
METRIC = re.compile(r"^[a-z][a-z0-9_]*(?:/[A-Za-z0-9_.{}-]+)+$")
# The files that make a training step's row (controller/loop.py assembles it), and the prefix their names
# get there: the trainer's dict goes under train/ (controller/step_metrics.py), but for model/*.
STEP_SOURCES = {
    "megarl/controller/loop.py": "", "megarl/controller/step_metrics.py": "", "megarl/controller/rollouts.py": "",
    "megarl/controller/weight_sync.py": "", "megarl/controller/summary.py": "", "megarl/controller/evaluation.py": "",
    "megarl/controller/dynamic_sampling.py": "", "megarl/controller/turns.py": "", "megarl/utils/metrics.py": "",
    "megarl/reward/pool.py": "", "megarl/reward/judge.py": "", "megarl/teacher/executor.py": "",
    "megarl/critic/executor.py": "", "megarl/critic/learner.py": "", "megarl/critic/model.py": "",
    "megarl/critic/value_loss.py": "", "megarl/trainer/lora.py": "",
    "megarl/trainer/train_step.py": "train/", "megarl/trainer/optimizer.py": "train/",
    "megarl/trainer/router_stats.py": "train/", "megarl/trainer/router_replay.py": "train/",
}
# The trainer's metrics without a '/': the keys of the dicts these functions build (and of `out[...]` /
# `timings[...]` they fill), under train/
TRAINER_DICTS = {"megarl/trainer/optimizer.py": ("optimizer_step", "build_training"),
                 "megarl/trainer/train_step.py": ("train_update", "reduce_updates", "prepare_batch")}
# Families the table writes with a <placeholder>: their members are made at run time
FAMILIES = {
    "train/loss/<name>": "the policy loss's metrics (docs/algorithms.md's table)",
    "lag/tokens_<k>": "one per lag 0 .. controller.max_policy_lag",
    "train/moe/expert_load/<e>": "one per expert",
    "eval/<set>/<metric>": "one set of eval/* per data.eval_paths entry",
}
# metric-shaped strings of those files that are no metric of the row: (file, string) -> why
NOT_METRICS = {("megarl/teacher/executor.py", "loss/{}"): "distill_metrics reads the trainer's loss/distill/reverse_kl"}
LOSS_SOURCES = ("megarl/algorithms/losses.py", "megarl/algorithms/metrics.py", "megarl/algorithms/policy_loss.py")
NOT_LOSS_METRICS = {"vaco/abs_dev": "vaco's batch sums (the TV estimate's inputs), not metrics",
                    "vaco/tokens": "vaco's batch sums (the TV estimate's inputs), not metrics"}


@functools.lru_cache(maxsize=None)
def _strings(rel: str) -> tuple[tuple[int, str, bool], ...]:
    """(line, text, is an f-string) of every string of a megarl file but its docstrings; an f-string's
    fields read ``{}``."""
    tree = ast.parse((ROOT / rel).read_text())
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, text, True))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.append((node.lineno, node.value, False))
    return tuple(out)


FSTRING = re.compile(r"""(?<![\w])[fF][rR]?(["'])((?:\{[^{}\n]*\}|(?!\1)[^\\\n{}])*)\1""")


@functools.lru_cache(maxsize=None)
def _megarl_text() -> tuple[str, frozenset]:
    """megarl/'s source, and its f-strings with a '/' as patterns (fields read ``{}``): read as text, not
    parsed (parsing every file takes seconds on a loaded machine)."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "megarl").rglob("*.py")))
    patterns = {re.sub(r"\{[^{}]*\}", "{}", m.group(2)) for m in FSTRING.finditer(text)}
    return text, frozenset(p for p in patterns if "/" in p)


def _quoted(s: str) -> bool:
    """Whether megarl/ has the string literal ``s``."""
    text, _ = _megarl_text()
    return f'"{s}"' in text or f"'{s}'" in text


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + "(.+?)".join(re.escape(part) for part in pattern.split("{}")) + "$")


def emitted(name: str) -> bool:
    """Whether megarl emits ``name`` (a table entry; ``<x>``: a placeholder): a string constant, or an
    f-string whose fields are string constants of megarl (``critic/{name}_mean`` with "value"), or for a
    family an f-string it starts with (``eval/{name}/``). The trainer's names go under train/."""
    _, patterns = _megarl_text()
    names = [name] + ([name[len("train/"):]] if name.startswith("train/") else [])
    for n in names:
        if "<" in n:
            canon = re.sub(r"<[^>]+>", "{}", n)
            if any(canon == p or (p.endswith("/") and canon.startswith(p)) for p in patterns if p.replace("{}", "")):
                return True
            continue
        if _quoted(n):
            return True
        for p in patterns:
            m = _pattern_regex(p).match(n)
            if m and len(p.replace("{}", "")) >= 3 and all(_quoted(g) for g in m.groups()):
                return True
    return False


def metrics_table(doc: Path = METRICS_DOC) -> list[tuple[int, str]]:
    """(line, name) of every name in the first column of ``doc``'s metrics table."""
    lines = doc.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if TABLE_HEADER.match(line)), None)
    assert start is not None, f"{_rel(doc)}: no metrics table (a header `| metric | unit | meaning | computed in |`)"
    out = []
    for i in range(start + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        first = lines[i].split("|")[1]
        out += [(i + 1, m.group(2)) for m in INLINE.finditer(first)]
    return out


def _trainer_keys(rel: str) -> list[tuple[int, str]]:
    """(line, key) of the trainer's metrics without a '/' (TRAINER_DICTS)."""
    tree, out = ast.parse((ROOT / rel).read_text()), []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name in TRAINER_DICTS.get(rel, ())):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Dict):
                out += [(k.lineno, k.value) for k in node.keys
                        if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("out", "timings") \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                out.append((node.lineno, node.slice.value))
    return out


def step_row_metrics() -> list[tuple[str, int, str, bool]]:
    """(file, line, name or pattern, is a pattern) of every metric the step-metrics paths emit."""
    out = []

    def add(rel, line, name, is_f, prefix):
        if prefix and not name.startswith(("model/", "train/")):
            name = prefix + name
        out.append((rel, line, name, is_f))

    for rel, prefix in STEP_SOURCES.items():
        assert (ROOT / rel).is_file(), f"tests/unit/test_docs_refs.py STEP_SOURCES names {rel}, which is gone: update it"
        for line, text, is_f in _strings(rel):
            if is_f and text.endswith("/"):
                text += "{}"  # `eval/{name}/` + a headline metric's name
            if METRIC.match(text) and (rel, text) not in NOT_METRICS:
                add(rel, line, text, is_f, prefix)
        for line, key in _trainer_keys(rel):
            add(rel, line, key, False, prefix)
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):  # the PhaseTimer's phases: time/<phase>
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "phase" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                add(rel, node.lineno, f"time/{node.args[0].value}", False, "")
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PHASES" for t in node.targets):
                out += [(rel, e.lineno, f"time/{e.value}", False) for e in node.value.elts]
    return out


def _family_regex(name: str) -> re.Pattern:
    return re.compile("^" + ".+".join(re.escape(part) for part in re.split(r"<[^>]+>", name)) + "$")


def test_the_metrics_table_names_only_emitted_metrics():
    table = metrics_table()
    assert len(table) > 50, f"{_rel(METRICS_DOC)}: the metrics table has {len(table)} names"
    problems = []
    for line, name in table:
        where = f"{_rel(METRICS_DOC)}:{line}"
        if "<" in name and name not in FAMILIES:
            problems.append(f"{where}: {name} is a family the test does not know (tests/unit/test_docs_refs.py "
                            f"FAMILIES)")
        elif not METRIC.match(re.sub(r"<[^>]+>", "x", name)):
            problems.append(f"{where}: `{name}` in the metric column is no metric name")
        elif not emitted(name):
            problems.append(f"{where}: {name} is in the metrics table but megarl emits no such metric")
    assert not problems, "\n".join(problems)


def test_every_metric_of_a_step_row_is_in_the_table():
    table = [name for _, name in metrics_table()]
    exact = set(table)
    families = [_family_regex(n) for n in table if "<" in n]
    found = step_row_metrics()
    assert len(found) > 50, f"only {len(found)} metrics found in STEP_SOURCES: the test reads nothing"
    problems, seen = [], set()
    for rel, line, name, is_f in found:
        if name in seen:
            continue  # said once, where it is first found
        seen.add(name)
        if is_f:  # documented if the table has it as a family, or names at least one of its members
            canon = [re.sub(r"<[^>]+>", "{}", n) for n in table]
            ok = name in canon or any(_pattern_regex(name).match(n) for n in table)
        else:
            ok = name in exact or any(r.match(name) for r in families)
        if not ok:
            problems.append(f"{rel}:{line}: {name} is a metric of the step's row but not in "
                            f"{_rel(METRICS_DOC)}'s metrics table")
    assert not problems, "\n".join(problems)


def test_every_loss_metric_is_in_the_algorithms_table():
    """The family train/loss/<name>: the metrics the policy loss returns are docs/algorithms.md's table."""
    doc = ROOT / "docs" / "algorithms.md"
    lines = doc.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "## Metrics")
    table = "\n".join(line for line in lines[start:] if line.startswith("|"))
    assert "`loss`" in table, f"{_rel(doc)}: no table under '## Metrics'"
    problems = []
    for rel in LOSS_SOURCES:
        for line, text, is_f in _strings(rel):
            if not METRIC.match(text.replace("{}", "x")) or text in NOT_LOSS_METRICS:
                continue
            fixed = max(text.split("{}"), key=len) if is_f else text  # `{name}/behav_weight_mean`: its fixed part
            if len(fixed.strip("/")) < 3:
                continue  # `{name}/{k}`: the PPO metrics under each loss's name, listed one by one
            if fixed not in table:
                problems.append(f"{rel}:{line}: the loss metric {text} is not in {_rel(doc)}'s '## Metrics' table")
    assert not problems, "\n".join(problems)
