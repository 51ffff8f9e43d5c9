"""The learning benchmark's harness (bench/learning.py), run by the ``command`` adapter in the session's
workspace: one chat call through the proxy with the task's instruction, the reply's text written to
``reply.json`` (a JSON string, so any text the random model samples stays one line of ASCII).

Reads what the ``command`` adapter puts in the environment: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``ROLLWIRE_MODEL`` and ``ROLLWIRE_INSTRUCTION``. The session fixes the sampling parameters (max_tokens,
temperature) whatever this sends.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path


def main() -> None:
    body = {"model": os.environ["ROLLWIRE_MODEL"],
            "messages": [{"role": "user", "content": os.environ["ROLLWIRE_INSTRUCTION"]}]}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        text = json.load(response)["choices"][0]["message"].get("content") or ""
    Path("reply.json").write_text(json.dumps(text) + "\n")


if __name__ == "__main__":
    main()
