"""Evaluation tasks shipped with the project, in the EleutherAI harness's task format (YAML),
built from the held-out end of tiny Shakespeare (``build.py`` makes the JSONL files):

    shakespeare_next_line     multiple choice: the speech's real next line among 4 (acc, acc_norm)
    shakespeare_passages      rolling log-likelihood of whole passages (word/byte perplexity)
    shakespeare_next_speaker  generation: who speaks after this speech (exact match)
    shakespeare               the group of all three

and one training set, for preference tuning (``finetune --task dpo --data NAME``), built from the
training part of the corpus:

    shakespeare_prefer_next_line  prompt: a speech's first line; chosen: its real next line;
                                  rejected: its words shuffled

``llm-foundry eval --tasks`` finds them by name; lm-eval finds them with
``--include_path`` set to ``TASKS_DIR``.
"""

from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).parent
LOCAL_TASKS = (
    "shakespeare_next_line",
    "shakespeare_passages",
    "shakespeare_next_speaker",
    "shakespeare",
)
# preference rows (DPO) by name: the JSONL file beside this one
PREFERENCE_TASKS = {"shakespeare_prefer_next_line": "prefer_next_line.jsonl"}
