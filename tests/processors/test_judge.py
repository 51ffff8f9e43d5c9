"""The ``judge`` evaluator: a rubric judge composed with another evaluator's outcome, on the real vLLM CPU
engine and the project's Kafka.

The tiny random model cannot grade anything, so the tests force its answer into the structured form
(vLLM's ``structured_outputs`` regex, through the judge's ``extra_body``), each session its own score: the
parsed score must reach the evaluation (``reward = outcome + coefficient × score / scale``, with the
judge's model, prompt digest and raw answer) and the group's advantages. Unforced, the random model's
answer under the JSON schema is not the structured form: that must be ``status: error`` after the bounded
retries, never a 0. A judge that answers garbage, one that does not answer in time and one that is not
there (a stand-in server for those) are errors with the reason. The judge's calls go to the engine
directly: no completion event is written for them.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI

from processors.evaluators.judge import JudgeEvaluator
from processors.evaluators.judge_client import CUT_MARK, JudgeRequest, messages_for
from processors.evaluators.judge_settings import JudgeSettings
from processors.evaluators.runner import EvaluatorRunner
from processors.groups.assembly import TaskFacts, TaskState, build_group, evaluation_fact, trajectory_fact
from schemas.evaluations import Evaluation
from schemas.judge import Judgement
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.tasks import AgentSpec, EvaluatorSpec
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from tests.servers import free_port, serve

RUBRIC = "10: the answer names the change plainly. 0: it does not."
OUTCOME = {"name": "session_completed", "settings": {}}


def forced(score: int, reason: str) -> dict[str, Any]:
    """Request fields that force the engine's answer to ``{"score": score, "reason": reason}``."""
    return {"response_format": None,
            "structured_outputs": {"regex": rf'\{{"score": {score}, "reason": "{reason}"\}}'}}


def session(task_id: str, index: int, settings: dict[str, Any]) -> tuple[SessionSpec, SessionEnded]:
    session_id = f"{task_id}-s{index}"
    spec = SessionSpec(session_id=session_id, task_id=task_id, sample_index=index,
                       instruction="Change the port to 8443 and say what you changed.",
                       agent=AgentSpec(harness="command", command="true"),
                       evaluator=EvaluatorSpec(name="judge", settings={
                           "rubric": RUBRIC, "outcome": OUTCOME, "coefficient": 0.5, "scale": 10,
                           "max_tokens": 48, **settings}))
    ended = SessionEnded(session_id=session_id, task_id=task_id, status=SessionStatus.COMPLETED,
                         patch="--- a/service.ini\n+++ b/service.ini\n@@ -1 +1 @@\n-port = 8080\n+port = 8443\n",
                         artifacts={"harness_stdout_tail": "I changed the port from 8080 to 8443."})
    return spec, ended


async def evaluations_for(kafka: KafkaSettings, session_ids: set[str], timeout_s: float) -> dict[str, Evaluation]:
    found: dict[str, Evaluation] = {}
    async with EventConsumer(kafka, [Topic.EVALUATIONS], group_id=None, service="test") as consumer:
        deadline = time.monotonic() + timeout_s
        while set(found) != session_ids and time.monotonic() < deadline:
            for received in await consumer.getmany(timeout_ms=500):
                if isinstance(received.event, Evaluation):
                    found[received.event.session_id] = received.event
    return found


async def completions_count(kafka: KafkaSettings) -> int:
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, service="test") as consumer:
        return len(await consumer.getmany(timeout_ms=1500))


@pytest.mark.kafka
async def test_the_judges_score_reaches_the_evaluation_and_the_groups_advantages(
        kafka: KafkaSettings, vllm_url: str) -> None:
    task_id = f"judged-{uuid.uuid4().hex[:6]}"
    sessions = [session(task_id, 0, {"extra_body": forced(8, "plain and correct")}),
                session(task_id, 1, {"extra_body": forced(2, "says nothing")}),
                session(task_id, 2, {"max_attempts": 2})]  # unforced: the random model's own answer
    async with EventProducer(kafka, service="test") as producer:
        await producer.send_many([spec for spec, _ in sessions])
        await producer.send_many([ended for _, ended in sessions])
    evaluator = JudgeEvaluator(judge_settings=JudgeSettings(url=vllm_url))
    runner = EvaluatorRunner(kafka, evaluator)
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    try:
        evaluations = await evaluations_for(kafka, {spec.session_id for spec, _ in sessions}, timeout_s=240)
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)
    good, low, unforced = (evaluations[spec.session_id] for spec, _ in sessions)

    for evaluation, score in ((good, 8.0), (low, 2.0)):
        assert evaluation.status == "ok", evaluation.error
        assert evaluation.reward == pytest.approx(1.0 + 0.5 * score / 10)
        judgement = Judgement.model_validate(evaluation.details["judge"])
        assert (judgement.score, judgement.model, judgement.url) == (score, "rollwire-tiny", vllm_url)
        assert judgement.raw is not None and f'"score": {score:g}' in judgement.raw
        assert len(judgement.prompt_sha256) == 64 and len(judgement.attempts) == 1
        assert evaluation.details["outcome"]["evaluator"] == "session_completed"
        assert evaluation.details["outcome"]["reward"] == 1.0 and evaluation.passed is True
    assert good.details["judge"]["prompt_sha256"] == low.details["judge"]["prompt_sha256"]  # same prompt

    assert unforced.status == "error" and unforced.reward is None
    failed = Judgement.model_validate(unforced.details["judge"])
    assert len(failed.attempts) == 2 and failed.parse_failures == 2 and failed.score is None
    assert "not the structured form" in (unforced.error or "")

    state = TaskState(TaskFacts(task_id, [spec.session_id for spec, _ in sessions], 3, 0.0, "judge", None, None))
    for (spec, _), evaluation in zip(sessions, (good, low, unforced)):
        state.add(trajectory_fact({"event_id": f"t-{spec.session_id}", "session_id": spec.session_id,
                                   "task_id": task_id, "session_status": "completed"}))
        state.add(evaluation_fact(evaluation.model_dump(mode="json")))
    group = build_group(state, default_evaluator="judge", estimator="grpo", eps=1e-6)
    first, second, errored = group.samples
    assert first.advantage is not None and second.advantage is not None
    assert first.advantage > 0 > second.advantage
    assert errored.advantage is None and not errored.in_baseline

    assert await completions_count(kafka) == 0, "a judge call reached the completions topic"
    judged = [Judgement.model_validate(e.details["judge"]) for e in (good, low, unforced)]
    print(f"\njudge on the vLLM CPU engine: judgements={len(judged)} calls={sum(len(j.attempts) for j in judged)} "
          f"parse_failures={sum(j.parse_failures for j in judged)} "
          f"seconds_per_judgement(forced)={statistics.mean([judged[0].seconds, judged[1].seconds]):.3f} "
          f"seconds(unforced, 2 calls)={judged[2].seconds:.3f}")


def _standin(answer: str, delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    calls: list[float] = []
    app.state.calls = calls

    @app.post("/v1/chat/completions")
    async def complete() -> dict[str, Any]:
        calls.append(time.monotonic())
        await asyncio.sleep(delay_s)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                             "finish_reason": "stop"}]}
    return app


@pytest.fixture
def garbage() -> Iterator[tuple[str, FastAPI]]:
    app = _standin("Sure! I'd give it a solid eight.")
    with serve(app) as url:
        yield url, app


@pytest.fixture
def slow() -> Iterator[tuple[str, FastAPI]]:
    app = _standin('{"score": 5, "reason": "late"}', delay_s=2.0)
    with serve(app) as url:
        yield url, app


async def judge_once(url: str, **settings: Any) -> Evaluation:
    spec, ended = session("standin", 0, {"url": url, "outcome": None, **settings})
    return await JudgeEvaluator(judge_settings=JudgeSettings(url=url)).evaluate(ended, spec)


async def test_a_judge_that_answers_garbage_is_an_error_after_its_retries(garbage: tuple[str, FastAPI]) -> None:
    url, app = garbage
    evaluation = await judge_once(url, max_attempts=3)
    assert evaluation.status == "error" and evaluation.reward is None
    assert "not the structured form" in (evaluation.error or "")
    judgement = Judgement.model_validate(evaluation.details["judge"])
    assert len(app.state.calls) == 3 and judgement.parse_failures == 3
    assert judgement.raw == "Sure! I'd give it a solid eight."


async def test_a_judge_that_does_not_answer_in_time_is_an_error(slow: tuple[str, FastAPI]) -> None:
    url, app = slow
    started = time.monotonic()
    evaluation = await judge_once(url, timeout_s=0.5, max_attempts=2)
    assert time.monotonic() - started < 1.8
    assert evaluation.status == "error" and "no answer within 0.5 s" in (evaluation.error or "")
    assert len(app.state.calls) == 2


async def test_an_unreachable_judge_is_an_error_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    evaluation = await judge_once(url, max_attempts=2)
    assert evaluation.status == "error" and f"{url} unreachable" in (evaluation.error or "")
    assert Judgement.model_validate(evaluation.details["judge"]).attempts[0].raw is None


async def test_an_outcome_evaluators_error_is_the_judges_error(garbage: tuple[str, FastAPI]) -> None:
    url, app = garbage
    evaluation = await judge_once(url, outcome={"name": "tests", "settings": {}})
    assert evaluation.status == "error" and "the outcome evaluator tests failed" in (evaluation.error or "")
    assert app.state.calls == [], "no judge call for a session whose outcome is unknown"


async def test_a_score_outside_the_scale_is_refused() -> None:
    app = _standin('{"score": 11, "reason": "generous"}')
    with serve(app) as url:
        evaluation = await judge_once(url, max_attempts=1)
    assert evaluation.status == "error" and "outside 0..10" in (evaluation.error or "")


def test_the_prompt_is_bounded_and_marks_its_cuts() -> None:
    request = JudgeRequest(url="http://judge", model="m", rubric="r", instruction="do it", answer="a" * 5000,
                           patch="p" * 20000, scale=10, coefficient=1, answer_chars=1000, patch_chars=2000)
    messages, truncated = messages_for(request)
    user = messages[1]["content"]
    assert truncated == ["answer", "patch"]
    assert CUT_MARK.format(n=4000) in user and CUT_MARK.format(n=18000) in user
    assert len(user) < 1000 + 2000 + 500
