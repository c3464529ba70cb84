"""Text files users write (traces, configuration, task files), read alike: UTF-8, with the byte-order mark
a spreadsheet's "CSV UTF-8" or an editor may put first dropped, and a file that is not UTF-8 named in a
one-line error."""

from __future__ import annotations

from pathlib import Path


class NotText(ValueError):
    """A user's file that is not UTF-8 text."""


def read_text(path: Path, name: str | None = None) -> str:
    """The file's text; NotText naming it (as `name`, else its path) when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise NotText(f"{name or path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
