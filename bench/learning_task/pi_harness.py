"""The learning benchmark through a real CLI: Pi (``@mariozechner/pi-coding-agent``, the pinned build
rollwire installs), run by the ``command`` adapter so that its reply can be scored.

Pi's own adapter (producers/adapters/pi.py) leaves the reply on Pi's stdout, where the `tests` evaluator
cannot see it (it scores the workspace's patch), and a random model never calls Pi's write tool. So this
wrapper writes the provider file the pi adapter writes (as ``producers.adapters.pi.pi_models`` does: the
session's chat URL and key, the model pinned, via the environment the ``command`` adapter sets), runs
``pi -p --provider rollwire --model M --no-session INSTRUCTION`` unmodified (Pi's system prompt, its tools,
its request shape), and writes its stdout to ``reply.json`` like bench/learning_task/harness.py.

    python pi_harness.py PI_EXECUTABLE
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def models_json() -> str:
    """Pi's provider file for this session (what producers.adapters.pi.pi_models writes)."""
    provider = {"baseUrl": os.environ["OPENAI_BASE_URL"].rstrip("/"), "api": "openai-completions",
                "apiKey": os.environ["OPENAI_API_KEY"],
                "models": [{"id": os.environ["ROLLWIRE_MODEL"], "reasoning": False, "contextWindow": 32768,
                            "maxTokens": 4096}]}
    return json.dumps({"providers": {"rollwire": provider}}, indent=2)


def main() -> int:
    pi = sys.argv[1]
    config = Path(os.environ["HOME"]) / ".pi" / "agent" / "models.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(models_json())
    instruction = os.environ["ROLLWIRE_INSTRUCTION"]
    env = {**os.environ, "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0", "NO_COLOR": "1"}
    done = subprocess.run([pi, "-p", "--provider", "rollwire", "--model", os.environ["ROLLWIRE_MODEL"],
                           "--no-session", instruction], env=env, capture_output=True, text=True, timeout=600)
    Path("reply.json").write_text(json.dumps(done.stdout.strip()) + "\n")
    sys.stderr.write(done.stderr[-2000:])
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
