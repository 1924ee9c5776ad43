"""The library's notes reach the console as whole lines, also while a progress bar is drawn."""

from __future__ import annotations

import io
import logging
import re

from tqdm import tqdm

from llm_foundry.cli import show_library_messages


def test_a_note_logged_under_a_progress_bar_gets_its_own_line(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    show_library_messages()
    with tqdm(total=10, file=err, mininterval=0, ascii=True) as bar:
        bar.update(3)
        logging.getLogger("llm_foundry.data.documents").warning("note: skipped 2 empty files")
        bar.update(7)
    # what a terminal shows on each line: the text after its last carriage return
    shown = [line.rsplit("\r", 1)[-1] for line in err.getvalue().split("\n")]
    assert "note: skipped 2 empty files" in shown, shown
    assert re.search(r"100%\|#+\| 10/10", err.getvalue())  # the bar redrawn and finished
