"""The learning benchmark's reward (bench/learning.py), run by the `tests` evaluator on a fresh checkout
with the session's patch applied: exit 0 (reward 1) when the reply in ``reply.json`` contains a
parenthesis, ``(`` or ``)``; exit 1 (reward 0) otherwise, or when there is no reply.

    python check.py reply.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = "()"


def rewarded(text: str) -> bool:
    """The toy property: some character of ``TARGET`` appears in the text."""
    return any(ch in text for ch in TARGET)


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "reply.json")
    if not path.is_file():
        print(f"no {path}: the harness wrote no reply")
        return 1
    text = json.loads(path.read_text())
    ok = rewarded(text)
    print(f"reply={text!r} rewarded={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
