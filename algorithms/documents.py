"""Reading a TOML or JSON document from a file: the one place that turns a file the parser rejects (or that is
not UTF-8) into the caller's one-line error naming the file, so a model, a matrix and a run manifest are all
refused the same way."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def parse_document(path: Path, parse: Callable[[str], T], *, bad: Callable[[ValueError], Exception]) -> T:
    """parse(the file's text); `bad(error)` is raised (without the parser's traceback) when the text is not
    UTF-8 or the parser rejects it (tomllib's and json's decode errors are ValueErrors)."""
    try:
        return parse(path.read_text())
    except ValueError as e:
        raise bad(e) from None
