"""Our models in the EleutherAI evaluation harness (``lm-eval``): an ``LM`` registered as
``llm-foundry`` that answers the harness's three kinds of request.

    loglikelihood          (context, continuation) -> (log p(continuation | context), greedy?)
    loglikelihood_rolling  (text,) -> log p(text), every token scored once in windows of the
                           model's context (the windows ``llm-foundry eval`` uses)
    generate_until         (context, {until, max_gen_toks, ...}) -> text, cut at a stop string

Tokenization follows the harness's ``hf`` backend, so the same weights give the same numbers:
a continuation is what encoding context + continuation adds after the context (trailing spaces
of the context move to the continuation), no BOS is added, and text with no context (rolling,
or an empty context) is conditioned on the BOS token (else EOS). A tokenizer with neither (our
character tokenizer) leaves the first token of such text unscored.

Used by ``llm-foundry eval --tasks``, from Python (``import llm_foundry.harness`` then
``lm_eval.simple_evaluate(model="llm-foundry", model_args="checkpoint=DIR")``), and from the
harness's own command line through ``python -m llm_foundry.harness run ...``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
except ImportError as e:  # the optional [eval] extra
    from llm_foundry.package import absent, missing_extra

    if not absent(e, "lm_eval"):
        raise  # installed but broken: its own error
    missing = missing_extra("the evaluation harness (lm-eval) is not installed", "eval", str(e))
    if __name__ == "__main__":  # `python -m llm_foundry.harness`: one line, as a usage error
        print(f"python -m llm_foundry.harness: error: {missing}", file=sys.stderr)
        sys.exit(2)
    raise missing from None
from tqdm import tqdm

from llm_foundry.evaluate import windows
from llm_foundry.generate import stream_batch
from llm_foundry.rundir import trained_block_size

NAME = "llm-foundry"


def score(
    model, rows: list[tuple[list[int], list[int]]], max_length: int, batch_size: int = 8, bar=False
) -> list[tuple[float, bool]]:
    """(sum of log p, all greedy?) of each continuation given its context, in batches.

    rows: (context ids, continuation ids), context non-empty; the last ``max_length`` tokens
    of context + continuation (less the final one) are the input."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]) - len(rows[i][1]))
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    device = next(model.parameters()).device
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc="loglikelihood", disable=not bar):
        inputs, conts = [], []
        for i in batch:
            ctx, cont = rows[i]
            if not ctx or not cont:
                raise ValueError(f"request {i}: empty context or continuation after encoding")
            if len(cont) > max_length:
                raise ValueError(
                    f"request {i}: a continuation of {len(cont)} tokens does not fit the "
                    f"model's context of {max_length}"
                )
            inputs.append((ctx + cont)[-(max_length + 1) :][:-1])
            conts.append(cont)
        width = max(len(x) for x in inputs)
        x = torch.tensor([row + [0] * (width - len(row)) for row in inputs], device=device)
        with torch.no_grad():
            logp = F.log_softmax(model(x)[0].float(), dim=-1)
        for row, (i, inp, cont) in enumerate(zip(batch, inputs, conts, strict=True)):
            start = len(inp) - len(cont)  # logits at these positions predict the continuation
            lp = logp[row, start : len(inp)]
            want = torch.tensor(cont, device=device)
            total = lp.gather(1, want[:, None]).sum().item()
            out[i] = (total, bool((lp.argmax(-1) == want).all()))
    return out  # type: ignore[return-value]


def rolling_rows(ids: list[int], max_length: int) -> list[tuple[list[int], list[int]]]:
    """The windows that score every token of ``ids`` after the first once, each with as much
    history as the context allows, as (context, continuation) rows for ``score``."""
    if len(ids) < 2:
        return []
    context = min(max_length, len(ids) - 1)
    return [
        (ids[start : start + skip + 1], ids[start + skip + 1 : start + context + 1])
        for start, skip in windows(len(ids), context, None)
    ]


@register_model(NAME)
class FoundryLM(TemplateLM):
    """lm-eval's view of a run directory, one of our checkpoints or an HF directory."""

    def __init__(
        self,
        checkpoint: str,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device: str = "cpu",
        tokenizer: str | None = None,
        adapter: str | None = None,
        **_ignored,  # the harness's options for other backends (max_batch_size, ...)
    ):
        super().__init__()
        from llm_foundry.loading import load_any

        self.model, self.tok, self.info = load_any(checkpoint, device or "cpu", tokenizer,
                                               adapter=adapter)  # fmt: skip
        if self.tok is None:
            raise FileNotFoundError(
                f"{self.info.checkpoint} has no tokenizer.json: pass tokenizer=FILE in model_args"
            )
        self.batch_size = 8 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        # by default the windows the weights were trained on (eval's default too), not the
        # positions the config allows: a model trained on 256 of 1024 scores worse past 256
        trained = trained_block_size(self.info.checkpoint) or self.model.cfg.max_seq_len
        self._max_length = int(max_length) if max_length else trained
        self.max_gen_toks = int(max_gen_toks)
        self._prefix = _prefix_token(self.tok)
        self._hf = getattr(self.tok, "kind", None) == "hf"
        names = ("bos_id", "eos_id", "pad_id")
        self._specials = {getattr(self.tok, n, None) for n in names} - {None}

    # the token-level interface TemplateLM builds on ----------------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int | None:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.info.checkpoint).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
        if self._hf:  # as the hf backend: no BOS unless asked
            return self.tok.encode(string, add_special_tokens=bool(add_special_tokens))
        return self.tok.encode(string)

    def tok_decode(self, ids, **_) -> str:
        """Text of ``ids`` without special tokens (as the hf backend decodes answers)."""
        if isinstance(ids, int):
            ids = [ids]
        return self.tok.decode([i for i in ids if i not in self._specials])

    # the three requests -----------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        rows = []
        for req in requests:
            context, continuation = req.args
            if context:
                rows.append(self._encode_pair(context, continuation))
                continue
            cont = self.tok_encode(continuation)
            if self._prefix is None or (cont and cont[0] == self._prefix):
                rows.append((cont[:1], cont[1:]))  # nothing to condition the first token on
            else:
                rows.append(([self._prefix], cont))
        return self._loglikelihood_tokens(
            [((r.args[0], r.args[1]), c, t) for r, (c, t) in zip(requests, rows, strict=True)],
            disable_tqdm=disable_tqdm,
        )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_):
        results = score(
            self.model,
            [(ctx, cont) for _, ctx, cont in requests],
            self.max_length,
            self.batch_size,
            bar=not disable_tqdm,
        )
        for (key, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, owner = [], []
        for n, req in enumerate(requests):
            ids = self.tok_encode(req.args[0])
            if self._prefix is not None:
                ids = [self._prefix, *ids]
            for row in rolling_rows(ids, self.max_length):
                rows.append(row)
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (lp, _) in zip(owner, score(self.model, rows, self.max_length, self.batch_size,
                                            bar=not disable_tqdm), strict=True):  # fmt: skip
            totals[n] += lp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample and a temperature) continuations in batches of
        requests with the same settings, each cut before its first stop string."""
        out: list[str | None] = [None] * len(requests)
        groups = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for key, members in groups.items():
            kwargs = normalize_gen_kwargs(json.loads(key), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)  # EOS: by id
            new = int(kwargs.pop("max_gen_toks"))
            if new >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={new} leaves no room for the context in the model's "
                    f"{self.max_length} positions"
                )
            temperature = float(kwargs.get("temperature") or 0.0)
            members.sort(key=lambda i: -len(requests[i].args[0]))
            for b in range(0, len(members), self.batch_size):
                batch = members[b : b + self.batch_size]
                prompts = [self._prompt(requests[i].args[0], new) for i in batch]
                texts = self._generate(prompts, new, until, temperature)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    def _prompt(self, context: str, new: int) -> list[int]:
        """The context's ids, cut from the left to leave ``new`` positions for the answer."""
        ids = self.tok_encode(context)[-(self.max_length - new) :]
        if ids:
            return ids
        if self._prefix is None:
            raise ValueError("an empty context needs a BOS or EOS token to start from")
        return [self._prefix]

    def _generate(self, prompts, new: int, until: list[str], temperature: float) -> list[str]:
        rows: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        eos = self.eot_token_id
        steps = stream_batch(self.model, prompts, new, temperature=temperature, seed=0)
        for step in steps:
            for r, t in enumerate(step.tolist()):
                if done[r]:
                    continue
                if t == eos:
                    done[r] = True
                    continue
                rows[r].append(t)
                if until and any(s in self.tok_decode(rows[r]) for s in until):
                    done[r] = True
            if all(done):
                break
        return [_cut(self.tok_decode(row), until) for row in rows]


def _cut(text: str, until: list[str]) -> str:
    """``text`` up to the first of the stop strings."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


def _prefix_token(tok) -> int | None:
    """The token text without context is conditioned on, as the hf backend picks it: the
    tokenizer's BOS, else its EOS (an HF tokenizer's ids are those its tokenizer_config.json
    names, set by ``tokenizer_files.open_tokenizer``)."""
    return tok.bos_id if tok.bos_id is not None else tok.eos_id


def evaluate_tasks(
    checkpoint: str | Path,
    tasks: list[str],
    batch_size: int = 8,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    include_path: str | Path | None = None,
    log_samples: bool = False,
    quiet: bool = True,
    adapter: str | Path | None = None,
) -> dict:
    """The harness's results dict for ``tasks`` on ``checkpoint`` (with the LoRA ``adapter``
    merged, when given); the local tasks are always found, ``include_path`` adds a directory of
    task YAMLs."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from llm_foundry.tasks import TASKS_DIR

    if quiet:  # the harness logs a warning per custom dataset and per default metric setting
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    paths = [str(TASKS_DIR)] + ([str(include_path)] if include_path else [])
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(
            f"--num-fewshot {num_fewshot} must be >= 0 (examples before each question)"
        )
    if include_path and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path {include_path}: no such directory")
    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_subtasks and t not in manager.all_groups
               and t not in manager.all_tags]  # fmt: skip
    if unknown:
        from llm_foundry.tasks import LOCAL_TASKS

        raise ValueError(
            f"unknown task(s) {', '.join(unknown)}: the local ones are {', '.join(LOCAL_TASKS)}; "
            "`lm-eval ls tasks` lists the harness's registry"
        )
    with _quiet_git_hash():
        return lm_eval.simple_evaluate(
            model=FoundryLM(
                str(checkpoint), batch_size=batch_size, adapter=str(adapter) if adapter else None
            ),  # fmt: skip
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
        )


def _git_hash() -> str | None:
    """The working directory's git commit, as the harness records it in its results; None
    outside a repository (without git's 'fatal: not a git repository' on our stderr)."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
    except OSError:  # no git installed
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _quiet_git_hash():
    """The harness's results record the git commit by running git with its stderr left open:
    outside a repository (an installed package's user) git's 'fatal: ...' line landed among our
    output. Within this context it asks git quietly."""
    from unittest import mock

    import lm_eval.evaluator

    return mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _git_hash)


def main(argv: list[str] | None = None) -> None:
    """The harness's own command line with ``--model llm-foundry`` available."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    with _quiet_git_hash():
        cli_evaluate()


if __name__ == "__main__":
    main()
