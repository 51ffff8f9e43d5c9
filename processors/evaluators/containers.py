"""What the evaluators that grade in a fresh container share: the docker runtime the containers come from,
made on first use (a test may hand in its own), and the tail of a command's output kept on the evaluation."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from processors.evaluators.base import Evaluator
from producers.runtimes.base import CommandResult, Runtime

OUTPUT_TAIL_CHARS = 4000


def output_tail(result: CommandResult) -> str:
    """The last :data:`OUTPUT_TAIL_CHARS` of a command's output and errors."""
    return (result.stdout + result.stderr)[-OUTPUT_TAIL_CHARS:]


class ContainerEvaluator(Evaluator):
    """An evaluator that runs its check in a fresh container of the session's image."""

    def __init__(self, settings: dict[str, Any] | None = None, *, runtime: Runtime | None = None,
                 scratch: Path | None = None) -> None:
        super().__init__(settings)
        self.scratch = scratch or Path(tempfile.gettempdir()) / "rollwire-evaluations"
        self._runtime = runtime

    def runtime(self) -> Runtime:
        """The docker runtime the containers come from (made on first use)."""
        if self._runtime is None:
            from producers.runtimes.docker import DockerRuntime

            self._runtime = DockerRuntime(self.scratch, mount_harness_cache=False)
        return self._runtime
