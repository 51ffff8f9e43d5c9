"""The layering rule, checked on the code's own imports (every import statement, lazy ones included).

    schemas                                  the contract: events, API models, topics, Kafka clients
    proxy | sinks | producers | processors   the services: each imports schemas and itself, never another
    deploy                                   the composition root: CLI, stack bring-up, the main job
    bench | examples                         on top: may use anything

One exception, named here: the `tests` evaluator (processors) scores a patch in the session's own kind of
sandbox, so processors may import ``producers.runtimes`` (and nothing else of producers). And no two
modules import each other, directly or around a loop.

``python -m tests.test_layers`` prints the package graph and the module cycles (none).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"schemas": 0, "proxy": 1, "sinks": 1, "producers": 1, "processors": 1, "deploy": 2, "bench": 3,
         "examples": 3}
EXCEPTIONS = {("processors", "producers.runtimes")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the project modules it imports, anywhere in its body (``from pkg import mod`` counts mod)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def _allowed(source: str, target: str) -> bool:
    top, target_top = source.split(".")[0], target.split(".")[0]
    if top == target_top:
        return True
    if any(top == a and (target == b or target.startswith(b + ".")) for a, b in EXCEPTIONS):
        return True
    return LAYER[target_top] < LAYER[top] and not (LAYER[top] == LAYER[target_top] == 1)


def violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if not _allowed(source, target))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_layers_point_down_only_and_no_module_import_cycles() -> None:
    # In a fresh interpreter: CPython 3.11's parser can fail with "AST constructor recursion depth mismatch"
    # in a process where deep recursion was caught before (the proxy's fuzz tests do that on purpose).
    result = subprocess.run([sys.executable, "-m", "tests.test_layers"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].endswith("violations=0 cycles=0"), result.stdout


def test_the_checker_sees_an_upward_import_and_a_cycle() -> None:
    graph = {"processors.topics": {"deploy.kafka"}, "deploy.kafka": {"schemas.topics"},
             "deploy.cli": {"producers.rollout.cli"}, "producers.rollout.cli": {"deploy.cli"},
             "processors.evaluators.tests_evaluator": {"producers.runtimes.local"},
             "sinks.feed": {"proxy.capture"}}
    assert violations(graph) == ["processors.topics -> deploy.kafka", "producers.rollout.cli -> deploy.cli",
                                 "sinks.feed -> proxy.capture"]
    assert cycles(graph) == [["deploy.cli", "producers.rollout.cli"]]


def main() -> int:
    graph = imports(project_modules())
    packages: dict[tuple[str, str], int] = defaultdict(int)
    for source, targets in graph.items():
        for target in targets:
            if source.split(".")[0] != target.split(".")[0]:
                packages[(source.split(".")[0], target.split(".")[0])] += 1
    for (source, target), count in sorted(packages.items(), key=lambda kv: (LAYER[kv[0][0]], kv[0])):
        print(f"{source} -> {target}: {count} imports")
    found_violations, found_cycles = violations(graph), cycles(graph)
    for line in found_violations:
        print(f"upward or sideways: {line}")
    for component in found_cycles:
        print(f"cycle: {' <-> '.join(component)}")
    print(f"modules={len(graph)} violations={len(found_violations)} cycles={len(found_cycles)}")
    return 1 if found_violations or found_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
