"""How a value a user gave appears in a one-line error: its ``repr``, cut to a length a line can
hold (a 10,000-item list or a 50 MB string is named by its start and its size, not echoed)."""

from __future__ import annotations

from collections.abc import Sized

LIMIT = 60  # characters of the value's repr an error shows


def shown(value: object, limit: int = LIMIT) -> str:
    """``repr(value)``, or its first ``limit`` characters with '...' and the value's size."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still named by its type
        return f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    size = ""
    if isinstance(value, Sized):
        unit = {str: "characters", bytes: "bytes"}.get(type(value), "items")
        size = f" ({len(value):,} {unit})"
    return f"{text[:limit]}...{size}"


MAX_ERROR = 2000  # characters of an error the command line prints


def capped(text: str, limit: int = MAX_ERROR) -> str:
    """``text`` whole when it fits ``limit``, else its start and end with what was cut between:
    the last guard for an error that echoes a value no check cut with ``shown``."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ... ({len(text) - 2 * half:,} characters cut) ... {text[-half:]}"


def one_line(text: object, limit: int = 300) -> str:
    """``text`` (an exception's message, say) on one line: whitespace runs made one space, cut
    to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


NAMED = 3  # a note names this many of the things it counts, at most


def first_few(names: list[str], total: int | None = None, limit: int = NAMED) -> str:
    """The first ``limit`` of ``names`` and how many more there are, in words ("a, b, c, and
    12 more"); ``total``: how many there are in all when ``names`` holds only the first few."""
    total = len(names) if total is None else total
    listed = names[:limit]
    more = total - len(listed)
    return ", ".join(listed) + (f", and {more:,} more" if more > 0 else "")
