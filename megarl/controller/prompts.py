"""The prompt stream: tokenized training prompts in a fixed shuffled order, and a held-out set
that is disjoint from them by content (normalized question text), checked, not assumed."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from megarl.config import ConfigError
from megarl.config.schema import MegaRLConfig

log = logging.getLogger("megarl")


def question_key(question: str) -> str:
    """What makes two questions the same: case and whitespace do not count."""
    return re.sub(r"\s+", " ", question).strip().lower()


def check_disjoint(train, held) -> None:
    """Raise if any held-out question also appears (by content) among the training questions."""
    shared = {question_key(t.question) for t in train} & {question_key(t.question) for t in held}
    if shared:
        example = next(iter(shared))
        raise ConfigError([f"{len(shared)} held-out question(s) also appear in the training data "
                           f"(e.g. {example!r}); evaluation would measure memorisation. Use a data.eval_path "
                           f"disjoint from data.train_path, or leave data.eval_path empty to hold out a slice"])


class PromptSource:
    """Training prompts (deterministic order, so a resumed run continues the same stream) and the
    held-out set, both tokenized with the model's chat template."""

    def __init__(self, cfg: MegaRLConfig, model_dir: Path):
        from transformers import AutoTokenizer

        from megarl.config.data_choice import eval_sets, instruction_for
        from megarl.data import format_prompt, split_train_eval
        from megarl.data.tasks import read_tasks

        d = cfg.data
        if d.choice:
            log.info("data: %s", d.choice)  # the row schemas recognised and the reward they chose (the loader's)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        keys = {"prompt_key": d.prompt_key, "answer_key": d.answer_key}
        counts: dict = {}
        schema, tasks = read_tasks(d.train_path, seed=d.seed, dedupe=d.dedupe, counts=counts, **keys)
        if counts.get("duplicates"):
            log.info("prompts: %d training row(s) repeat an earlier prompt and are not kept (data.dedupe); the first "
                     "is %s", counts["duplicates"], counts["first_duplicate"])
        # Held-out sets: (name, tasks, instruction, answer style); name '' = the single eval_path or slice,
        # logged as eval/*; data.eval_paths: each named, logged as eval/<name>/* (the first also as eval/*).
        style = lambda sch: sch.eval_answer if d.eval_answer == "auto" else d.eval_answer  # noqa: E731
        sets = []
        if d.eval_paths or d.eval_path:
            for name, path in eval_sets(d) or [("", d.eval_path)]:
                held_schema, held = read_tasks(path, limit=d.eval_size, dedupe=d.dedupe, **keys)
                sets.append((name, held, instruction_for(cfg, held_schema), style(held_schema)))
            held_keys = {question_key(t.question) for _, held, _, _ in sets for t in held}
            train = [t for t in tasks if question_key(t.question) not in held_keys]
            if len(train) < len(tasks):
                log.info("prompts: dropped %d training question(s) that are also in a held-out set",
                         len(tasks) - len(train))
        else:
            train, held = split_train_eval(tasks, cfg.data.eval_size, seed=cfg.data.seed)
            sets.append(("", held, instruction_for(cfg, schema), style(schema)))
        for _, held, _, _ in sets:
            check_disjoint(train, held)

        # Longer prompts are skipped and counted (self.skipped): past max_model_len - max_new_tokens
        # the engine could not generate a full reply; past data.max_prompt_tokens the user said so.
        room = cfg.generator.max_model_len - cfg.generator.max_new_tokens
        self.max_prompt_tokens = min(cfg.data.max_prompt_tokens, room)
        why = (f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}" if cfg.data.max_prompt_tokens <= room else
               f"generator.max_model_len={cfg.generator.max_model_len} - generator.max_new_tokens="
               f"{cfg.generator.max_new_tokens}")
        self.skipped: dict[str, int] = {}

        def encode(items, what: str, instruction: str):
            kept = [(t, self.tokenizer.encode(format_prompt(t, self.tokenizer, chat_template=d.chat_template,
                                                            instruction=instruction, system_prompt=d.system_prompt),
                                              add_special_tokens=False)) for t in items]
            long = [(t, ids) for t, ids in kept if len(ids) > self.max_prompt_tokens]
            self.skipped[what] = len(long)
            if long:
                t, ids = long[0]
                log.warning("prompts: %d of %d %s prompt(s) longer than %d tokens (%s) skipped; the first is %s "
                            "(%d tokens)", len(long), len(kept), what, self.max_prompt_tokens, why,
                            t.where or repr(t.question[:40]), len(ids))
            return [(t, ids) for t, ids in kept if len(ids) <= self.max_prompt_tokens]

        self.train = encode(train, "train", instruction_for(cfg, schema))
        # (name, [(task, ids)], answer style) per held-out set; the first is the headline
        self.held_sets = [(name, encode(held, f"held-out {name}".strip(), instruction), how)
                          for name, held, instruction, how in sets]
        self.held, self.eval_answer = self.held_sets[0][1], self.held_sets[0][2]
        if not self.train:
            raise ConfigError([f"data.train_path={cfg.data.train_path!r}: no prompt fits in {self.max_prompt_tokens} "
                               f"tokens ({why})"])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for name, held, how in self.held_sets:
            log.info("prompts: %d train, %d held-out%s (disjoint by content); held-out replies are judged on their %s",
                     len(self.train), len(held), f" in {name}" if name else "",
                     "last \\boxed{} (math-verify equivalence)" if how == "boxed" else "last number")

    def batch(self, index: int, size: int):
        """The ``index``-th batch of ``size`` (task, prompt ids) rows."""
        rows = [self.train[(index * size + i) % len(self.train)] for i in range(size)]
        return [t for t, _ in rows], [ids for _, ids in rows]

    def eval_set(self):
        """(tasks, prompt ids) of the headline held-out set."""
        return [t for t, _ in self.held], [ids for _, ids in self.held]

    def eval_sets(self):
        """[(name, tasks, prompt ids, answer style)] of every held-out set; name '' for the single one."""
        return [(name, [t for t, _ in held], [ids for _, ids in held], how) for name, held, how in self.held_sets]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
