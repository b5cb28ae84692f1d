"""One helper for the benchmark tools: put a tool's section into docs/benchmarks.md."""

from __future__ import annotations

import os


def replace_section(docs: str, begin: str, end: str, section: str) -> None:
    """Replace the text between the ``begin`` and ``end`` markers in
    ``docs/benchmarks.md`` with ``section`` (which carries both markers), or append it."""
    path = os.path.join(docs, "benchmarks.md")
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)
