"""Writes examples/swebench/tasks-scripted.jsonl: the SWE-style instances as TaskRequests whose turns are
scripted for the embedded tiny (random) model, so that a run shows a resolved instance end to end.

Each task's ``engine.turns`` force, by token id (``tests.harnesses.common.forced_turn``: the tiny model's
own template ids), one Qwen Code ``run_shell_command`` call that writes the gold fix (base64, so nothing
needs quoting), then an answer. Run from the repository root::

    PYTHONPATH=. .venv/bin/python examples/swebench/make_scripted.py
"""

import base64, json, shutil, subprocess, tempfile
from pathlib import Path
from schemas.swebench import read_instances, to_task_request
from schemas.tasks import EngineParams
from tests.harnesses.common import Script, ToolStep

EX = Path(__file__).resolve().parent
records, bad = read_instances(EX / "instances.jsonl")
lines = []
for rec in records:
    inst = rec.instance
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "r"
        shutil.copytree(EX / "repos" / inst.instance_id, repo)
        subprocess.run(["patch", "-p1", "--batch", "-s"], cwd=repo, input=inst.patch, text=True, check=True)
        names = [l[6:] for l in inst.patch.splitlines() if l.startswith("+++ b/")]
        fixed = {n: (repo / n).read_text() for n in names}
    script = Script(steps=tuple(ToolStep("run_shell_command", {
        "command": f"echo {base64.b64encode(t.encode()).decode()} | base64 -d > {n}",
        "description": f"Write the fixed {n}"}) for n, t in fixed.items()),
        answer="Fixed; the tests pass now.", expected_files={})
    task = to_task_request(inst, harness="qwen-code", engine=EngineParams(max_tokens=1024, turns=script.turns()),
                           timeout_s=600)
    doc = task.model_dump(mode="json", exclude_defaults=True)
    doc["task_id"] = f"{inst.instance_id}-scripted"
    doc["metadata"]["scripted"] = True
    lines.append(json.dumps(doc))
head = ("# The SWE-style instances as TaskRequests with scripted turns, for the embedded tiny (random) model: each\n"
        "# session's engine.turns force, by token id, one Qwen Code run_shell_command call that writes the gold fix\n"
        "# (base64, so no quoting), then an answer. Graded by the swebench evaluator in a fresh container: resolved.\n"
        "# Written by examples/swebench/make_scripted.py.\n"
        "# `rollwire rollout examples/swebench/tasks-scripted.jsonl --samples 2`\n")
(EX / "tasks-scripted.jsonl").write_text(head + "\n".join(lines) + "\n")
print(len(lines), "tasks")
