"""``--task FILE.jsonl``: your own traffic. One JSON object per line (blank lines skipped):

- ``{"prompt": "..."}``: sent to ``/v1/completions`` as it is;
- ``{"messages": [{"role": "user", "content": "..."}, ...]}``: sent to ``/v1/chat/completions``,
  rendered by the served model's chat template (roles system / developer / user / assistant / tool;
  content a string or a list of ``{"type": "text", "text": ...}`` parts);
- optional: ``id`` (string or integer, unique; default: the line number), ``category`` (string:
  acceptance is then reported per category), ``max_tokens`` (integer >= 1; default ``--max-tokens``,
  else 256), ``stop`` (a string or a list of strings). Other keys are ignored.

Greedy, one turn per row. A malformed row is one line naming FILE:LINE and the field (exit 2).
Nothing is scored: the workload measures acceptance, speed and the lossless check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate.workloads.base import Item, LoadOptions, Workload

DEFAULT_MAX_TOKENS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")


def load(path: Path, opts: LoadOptions) -> Workload:
    if not path.is_file():
        raise UsageError(f"--task {path}: no such file (a FILE.jsonl of rows with 'prompt' or 'messages')")
    name = path.name
    items: list[Item] = []
    seen: dict[str, int] = {}
    for n, line in _lines(path):
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{where}: not JSON ({err.msg} at column {err.colno})") from err
        item = _item(row, where, name, n, opts)
        if item.id in seen:
            raise UsageError(f"{where}: 'id' {item.doc.get('id', n)!r} repeats line {seen[item.id]}")
        seen[item.id] = n
        items.append(item)
    if not items:
        raise UsageError(f"--task {path}: no rows")
    if opts.limit is not None:
        items = items[: opts.limit]
    return Workload(name, items, str(path))


def _lines(path: Path) -> list[tuple[int, str]]:
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UsageError(f"{path}:{n}: not UTF-8 text") from err
            if line.strip():
                out.append((n, line))
    return out


def _item(row: Any, where: str, name: str, n: int, opts: LoadOptions) -> Item:
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object with 'prompt' or 'messages', got {type(row).__name__}")
    if ("prompt" in row) == ("messages" in row):
        raise UsageError(f"{where}: give 'prompt' or 'messages'" + (", not both" if "prompt" in row else ""))
    prompt, messages = None, None
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise UsageError(f"{where}: 'prompt' must be a non-empty string")
    else:
        messages = _messages(row["messages"], where)
    rid = row.get("id", n)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise UsageError(f"{where}: 'id' must be a non-empty string or an integer")
    category = row.get("category")
    if category is not None and (not isinstance(category, str) or not category):
        raise UsageError(f"{where}: 'category' must be a non-empty string")
    max_tokens = row.get("max_tokens", opts.max_tokens or DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise UsageError(f"{where}: 'max_tokens' must be an integer >= 1")
    stop = row.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise UsageError(f"{where}: 'stop' must be a non-empty string or a list of them")
    return Item(f"{name}/{rid}", name, category, prompt=prompt, messages=messages, stop=tuple(stop),
                max_tokens=max_tokens, doc=row)


def _messages(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise UsageError(f"{where}: '{field}' must be an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise UsageError(f"{where}: '{field}.role' must be one of {', '.join(ROLES)}")
        content = m.get("content")
        ok = isinstance(content, str) or (isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str)
            for p in content))
        if not ok:
            raise UsageError(f"{where}: '{field}.content' must be a string or a list of "
                             f"{{'type': 'text', 'text': ...}} parts")
        out.append(dict(m))
    return tuple(out)
