"""The verl bridge (sinks/bridges/verl.py): verl 0.9.1's own advantage and rollout-correction functions, run
in verl's own environment (deploy/verl_env.py) on the batch the bridge builds from rollwire's rows, give
the advantages and truncated importance sampling weights rollwire gives (to 1e-6).

The rows are real: the recorded CLI sessions (tests/fixtures/sessions, real engine tokens and logprobs)
built by rollwire's builders (prefix_merging: one row per chain, tool outputs at mask 0; per_request: one
row per call), rewarded through evaluation events and grouped by the groups worker's own assembly
(processors/groups/assembly.py), laid into a feed batch by the feed's own sequence and padding code, and
read back by the bridges' :func:`~sinks.bridges.rows.rows_of_batch`. Three groups: single-row sessions;
multi-branch sessions (two recordings spliced into one session, so prefix_merging opens a second chain,
and a per_request session of five rows); and a group with one usable sample (the other failed for the
infrastructure). Two branches lack logprobs: one recorded without them (the builder masks its sampled
tokens out, so the feed never yields it), and one row whose logprobs are blanked after the feed, as an
RL rows file with null logprobs gives it to the bridge. The trainer's logprobs, which verl's actor would
compute, are the rollout logprobs moved by seeded noise, so that some importance weights pass the cap.

verl's side runs in a child process with verl's interpreter (tests/sinks/verl_side.py); rollwire's TIS
weights are computed by the reference trainer's own function in a child Python with the borrowed torch
(torch is never imported into this test process, whose transformers decides at import time whether torch
is there).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from processors.builders import SessionFacts, build_trajectory
from processors.groups.advantages import DEFAULT_EPS
from processors.groups.assembly import TaskFacts, TaskState, build_group, evaluation_fact, trajectory_fact
from schemas import paths
from schemas.completions import Completion
from schemas.groups import Group
from schemas.sessions import FailureKind, SessionStatus
from schemas.trajectories import Trajectory
from sinks.batching import TrainingSequence, pad_sequences
from sinks.bridges.rows import Row, RowCounts, rows_of_batch
from sinks.bridges.verl import VerlBatch, load_npz, save_npz, to_verl
from sinks.feed import Batch
from sinks.join import IndexedTrajectory
from sinks.sources import FeedStats, trace_sequences
from tests.sinks import evaluation

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "sessions"
ROLES = frozenset({"main", "sub_agent"})
IS_CAP = 2.0
BLANKED = "branched-a/1"  # the row whose logprobs are blanked
TOLERANCE = 1e-6


# -- real rows, through rollwire's builders, groups and feed code ------------------------------------------

def _calls(cli: str, session_id: str, task_id: str, *, first: int = 0, logprobs: bool = True) -> list[Completion]:
    """A recorded CLI session's completions, as session ``session_id`` of ``task_id`` (sequences from ``first``)."""
    events = []
    for line in (FIXTURES / f"{cli}-1.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            event = Completion.model_validate_json(line)
            update: dict[str, Any] = {"session_id": session_id, "task_id": task_id, "sequence": first + event.sequence}
            if not logprobs:
                update["logprobs"] = None
            events.append(event.model_copy(update=update))
    return events


def _trajectory(builder: str, calls: list[Completion], *, failure: FailureKind | None = None) -> Trajectory:
    first = calls[0]
    facts = SessionFacts(session_id=first.session_id, task_id=first.task_id,
                         status=SessionStatus.ERROR if failure else SessionStatus.COMPLETED, failure=failure)
    return build_trajectory(builder, calls, facts)


def _group(task_id: str, trajectories: list[Trajectory], rewards: list[float]) -> Group:
    """The task's group as the groups worker assembles it from the trajectory and evaluation events."""
    facts = TaskFacts(task_id, [t.session_id for t in trajectories], len(trajectories), time.time() + 3600,
                      "tests", f"g-{task_id}", None)
    state = TaskState(task=facts)
    for trajectory, reward in zip(trajectories, rewards, strict=True):
        state.add(trajectory_fact(json.loads(trajectory.model_dump_json())))
        state.add(evaluation_fact(json.loads(evaluation(trajectory.session_id, task_id, reward).model_dump_json())))
    return build_group(state, default_evaluator="tests", estimator="grpo", eps=DEFAULT_EPS)


def _sequences(group: Group, trajectories: list[Trajectory]) -> list[TrainingSequence]:
    """The group's training sequences as the feed's group source makes them (samples without an
    advantage left out)."""
    indexed = {t.event_id: IndexedTrajectory.of(t) for t in trajectories}
    sequences: list[TrainingSequence] = []
    for sample in group.samples:
        if sample.advantage is None or sample.trajectory_id is None:
            continue
        sequences += trace_sequences(indexed[sample.trajectory_id], ROLES, FeedStats(), advantage=sample.advantage,
                                     reward=sample.reward, task_id=group.task_id,
                                     group_id=group.group_id or group.task_id, oldest=None)
    return sequences


def _feed_batch(sequences: list[TrainingSequence]) -> Batch:
    """A padded numpy feed batch of these sequences, laid out as TrainerFeed lays one out."""
    arrays = pad_sequences(sequences)
    return Batch(number=0, packed=False, input_ids=arrays.input_ids, attention_mask=arrays.attention_mask,
                 position_ids=arrays.position_ids, loss_mask=arrays.loss_mask, logprobs=arrays.logprobs,
                 advantages=arrays.advantages, segment_ids=arrays.segment_ids,
                 session_ids=[s.session_id for s in sequences], group_ids=[s.group_id for s in sequences],
                 task_ids=[s.task_id for s in sequences], trajectory_ids=[s.trajectory_id for s in sequences],
                 trace_ids=[s.trace_id for s in sequences],
                 sample_advantages=[math.nan if s.advantage is None else s.advantage for s in sequences],
                 spans=arrays.spans, group_event_ids=[], offsets={}, missing_logprobs=arrays.missing_logprobs,
                 sample_rewards=[math.nan if s.reward is None else s.reward for s in sequences])


def _rollwire_batch() -> tuple[Batch, list[Group]]:
    """Three groups (the module docstring) as one feed batch."""
    single = [_trajectory("prefix_merging", _calls(cli, f"single-{cli}", "single")) for cli in
              ("qwen-code", "claude-code", "codex", "pi")]
    branched = [
        _trajectory("prefix_merging", _calls("pi", "branched-a", "branched") +
                    _calls("codex", "branched-a", "branched", first=5)),
        _trajectory("prefix_merging", _calls("codex", "branched-b", "branched") +
                    _calls("pi", "branched-b", "branched", first=5, logprobs=False)),
        _trajectory("per_request", _calls("claude-code", "branched-c", "branched")),
    ]
    lonely = [_trajectory("prefix_merging", _calls("pi", "lonely-a", "lonely")),
              _trajectory("prefix_merging", _calls("qwen-code", "lonely-b", "lonely"),
                          failure=FailureKind.INFRASTRUCTURE)]
    groups = [_group("single", single, [1.0, 0.0, 0.5, 1.0]), _group("branched", branched, [0.25, 1.0, 0.0]),
              _group("lonely", lonely, [1.0, 0.0])]
    sequences = []
    for group, trajectories in zip(groups, (single, branched, lonely)):
        sequences += _sequences(group, trajectories)
    return _feed_batch(sequences), groups


def _trainer_logprobs(batch: Batch, seed: int = 7) -> np.ndarray:
    """What the trainer's policy gives the batch's sampled tokens: the rollout's, moved by seeded noise."""
    noise = np.random.default_rng(seed).normal(0.0, 0.6, batch.logprobs.shape).astype(np.float32)
    return np.where(batch.loss_mask == 1, batch.logprobs + noise, 0.0).astype(np.float32)


def _by_trace(batch: Batch, values: np.ndarray) -> dict[str, np.ndarray]:
    return {trace: values[r, :int(batch.attention_mask[r].sum())] for r, trace in enumerate(batch.trace_ids)}


# -- the two sides ---------------------------------------------------------------------------------------

def _rollwire_tis(batch: Batch, old: np.ndarray, tmp_path: Path) -> np.ndarray:
    """The reference trainer's truncated importance weights (sinks/trainer/loss.py), in a child Python."""
    source, out = tmp_path / "rollwire_in.npz", tmp_path / "rollwire_out.npz"
    np.savez(source, old=old, rollout=batch.logprobs, mask=batch.loss_mask)
    code = ("import sys, numpy as np\n"
            "from sinks.trainer import import_torch, truncated_importance_weights\n"
            "torch = import_torch()\n"
            "d = np.load(sys.argv[1])\n"
            "w = truncated_importance_weights(torch.from_numpy(d['old']), torch.from_numpy(d['rollout']),\n"
            "                                 torch.from_numpy(d['mask']), is_cap=float(sys.argv[3]))\n"
            "np.savez(sys.argv[2], weights=w.numpy())\n")
    done = subprocess.run([sys.executable, "-c", code, str(source), str(out), str(IS_CAP)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as data:
        return np.asarray(data["weights"])


def _verl(batch: VerlBatch, tmp_path: Path) -> dict[str, Any]:
    """verl's functions on the bridge's batch, in verl's environment (installed once)."""
    from deploy.verl_env import ensure_verl_env

    env = ensure_verl_env(paths.cache_dir())
    source, out = save_npz(batch, tmp_path / "verl_in.npz"), tmp_path / "verl_out.npz"
    done = subprocess.run([str(env / "bin" / "python"), str(REPO / "tests" / "sinks" / "verl_side.py"), str(source),
                           str(out), "--is-threshold", str(IS_CAP)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": "", "VERL_USE_EXTERNAL_PLUGINS": "none",
                               "RAY_USAGE_STATS_ENABLED": "0", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out, allow_pickle=False) as data:
        result: dict[str, Any] = {k: np.asarray(data[k]) for k in data.files if k != "versions"}
        result["versions"] = json.loads(str(data["versions"]))
    return result


@pytest.fixture(scope="module")
def bridged() -> dict[str, Any]:
    """The real batch and the bridge's verl batch of it (no verl needed)."""
    batch, groups = _rollwire_batch()
    old = _trainer_logprobs(batch)
    rows = [replace(row, logprobs=np.full(len(row), np.nan, dtype=np.float32)) if row.trace_id == BLANKED else row
            for row in rows_of_batch(batch)]
    counts = RowCounts()
    verl_batch = to_verl(rows, counts=counts, per_token={"old_log_probs": _by_trace(batch, old)})
    return {"batch": batch, "groups": groups, "old": old, "verl_batch": verl_batch, "counts": counts}


@pytest.fixture(scope="module")
def compared(bridged: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both sides on the same real batch: rollwire's TIS weights, and what verl computed."""
    tmp_path = tmp_path_factory.mktemp("verl")
    verl = _verl(bridged["verl_batch"], tmp_path)  # first: it installs the vLLM environment torch is borrowed from
    return {**bridged, "verl": verl, "rollwire_tis": _rollwire_tis(bridged["batch"], bridged["old"], tmp_path)}


# -- tests -------------------------------------------------------------------------------------------------

def test_verl_grpo_gives_rollwires_advantages(compared: dict[str, Any]) -> None:
    """verl's v1 GRPO (each session's final row, broadcast to its branches) on the bridge's rewards gives
    the advantages rollwire's groups worker gave, on every response token of every row."""
    mine: VerlBatch = compared["verl_batch"]
    verl = compared["verl"]
    mask = mine.tensors["response_mask"]
    diff = float(np.abs(verl["advantages"] - mine.tensors["advantages"]).max())
    lengths = mine.tensors["attention_mask"][:, mine.tensors["prompts"].shape[1]:].sum(axis=1)
    inside = int(sum((mask[b, :int(lengths[b])] == 0).sum() for b in range(len(mine))))  # tool outputs, glue
    print(f"advantages: rows={len(mine)} trained_tokens={int(mask.sum())} masked_response_tokens={inside} "
          f"max_abs_diff={diff:.3g}")
    assert diff <= TOLERANCE
    assert np.all(verl["advantages"][mask == 0] == 0)
    # Per row, the session's advantage from the groups worker's event, the same on all its rows.
    by_session = {s.session_id: s.advantage for g in compared["groups"] for s in g.samples}
    first = mask.argmax(axis=1)
    for b, session in enumerate(mine.non_tensors["session_ids"]):
        assert abs(float(verl["advantages"][b, first[b]]) - by_session[str(session)]) <= TOLERANCE
    assert verl["versions"]["verl"] == "0.9.1"
    assert verl["versions"]["transformers"].startswith("5.10.")  # verl's pin, not rollwire's transformers


def test_per_row_grpo_counts_a_branched_session_once_per_row(compared: dict[str, Any]) -> None:
    """Why the bridge gives verl its v1 session keys: verl's plain GRPO over rows counts a multi-branch
    session once per row and gets other advantages for its group; on single-row sessions it agrees."""
    mine: VerlBatch = compared["verl_batch"]
    per_row, mask = compared["verl"]["advantages_per_row"], mine.tensors["response_mask"]
    uid = mine.non_tensors["uid"]
    single, branched = uid == "g-single", uid == "g-branched"
    assert float(np.abs(per_row[single] - mine.tensors["advantages"][single]).max()) <= TOLERANCE
    off = float(np.abs(per_row[branched] - mine.tensors["advantages"][branched]).max())
    print(f"per-row GRPO on the multi-branch group is off by up to {off:.3f}")
    assert off > 0.01
    assert mask[branched].shape[0] > len(set(mine.non_tensors["session_ids"][branched]))


def test_verl_tis_weights_are_rollwires(compared: dict[str, Any]) -> None:
    """verl's token-level TIS (rollout_corr_helper, ``rollout_is: token``) against the bridge's
    ``rollout_log_probs`` gives the weights rollwire's reference trainer gives, token for token on every
    trained token; some pass the cap, so the truncation is compared too."""
    batch: Batch = compared["batch"]
    mine: VerlBatch = compared["verl_batch"]
    verl, rollwire = compared["verl"], compared["rollwire_tis"]
    rows = {trace: r for r, trace in enumerate(batch.trace_ids)}
    worst, tokens, capped = 0.0, 0, 0
    for b, trace in enumerate(mine.non_tensors["trace_ids"]):
        r = rows[str(trace)]
        theirs = verl["rollout_is_weights"][b][mine.tensors["response_mask"][b] == 1]
        ours = rollwire[r][batch.loss_mask[r] == 1]
        assert theirs.shape == ours.shape
        worst = max(worst, float(np.abs(theirs - ours).max()))
        tokens += len(ours)
        capped += int((ours == IS_CAP).sum())
    print(f"tis: rows={len(mine)} tokens={tokens} capped={capped} max_abs_diff={worst:.3g}")
    assert worst <= TOLERANCE
    assert capped > 0 and tokens == mine.trained_tokens
    assert np.all(verl["rollout_is_weights"][mine.tensors["response_mask"] == 0] == 0)
    assert np.array_equal(verl["response_mask"], mine.tensors["response_mask"])  # no rejection configured


def test_bad_input_is_passed_over_and_counted(bridged: dict[str, Any]) -> None:
    """A row without logprobs leaves the batch (its session stays, by its other branch); a group with one
    usable sample leaves it whole; both counted. A branch recorded without logprobs never reaches the
    feed's batch (the builder masked its tokens out)."""
    batch: Batch = bridged["batch"]
    mine: VerlBatch = bridged["verl_batch"]
    counts: RowCounts = bridged["counts"]
    assert counts.rows_without_logprobs == 1
    assert counts.groups_too_small == 1
    assert counts.rows == len(batch.trace_ids) and counts.rows_used == len(mine)
    kept = set(mine.non_tensors["session_ids"].tolist())
    assert {"branched-a", "branched-b"} <= kept and not any(s.startswith("lonely") for s in kept)
    assert BLANKED in batch.trace_ids and BLANKED not in mine.non_tensors["trace_ids"].tolist()
    assert [t for t in batch.trace_ids if t.startswith("branched-b/")] == ["branched-b/0"]
    assert "lonely-a" in batch.session_ids  # the feed gave it; the bridge drops it


def test_layout_is_verls(bridged: dict[str, Any]) -> None:
    """The fields as verl's agent loop lays them out: left-padded prompts, right-padded responses,
    position ids from the attention mask, the reward on the last response token, and the rows' tokens
    intact (the tool outputs inside a response at mask 0)."""
    batch: Batch = bridged["batch"]
    mine: VerlBatch = bridged["verl_batch"]
    t = mine.tensors
    width = t["prompts"].shape[1]
    assert np.array_equal(t["input_ids"], np.concatenate([t["prompts"], t["responses"]], axis=1))
    assert np.array_equal(t["position_ids"], np.clip(np.cumsum(t["attention_mask"], axis=1) - 1, 0, None))
    rows = {trace: r for r, trace in enumerate(batch.trace_ids)}
    inside_zeros = 0
    for b, trace in enumerate(mine.non_tensors["trace_ids"]):
        r = rows[str(trace)]
        real = t["attention_mask"][b] == 1
        assert np.array_equal(t["input_ids"][b][real], batch.input_ids[r][batch.attention_mask[r] == 1])
        assert t["attention_mask"][b, width] == 1  # the response starts right after the prompt's padding
        length = int(t["attention_mask"][b, width:].sum())
        assert t["token_level_rewards"][b, length - 1] == pytest.approx(batch.sample_rewards[r])
        assert np.count_nonzero(t["token_level_rewards"][b]) <= 1
        inside_zeros += int((t["response_mask"][b, :length] == 0).sum())
    assert inside_zeros > 0


def test_npz_round_trip(bridged: dict[str, Any], tmp_path: Path) -> None:
    mine: VerlBatch = bridged["verl_batch"]
    back = load_npz(save_npz(mine, tmp_path / "b.npz"))
    assert set(back.tensors) == set(mine.tensors) and set(back.non_tensors) == set(mine.non_tensors)
    for name, value in mine.tensors.items():
        assert np.array_equal(back.tensors[name], value) and back.tensors[name].dtype == value.dtype


def test_nothing_usable_is_an_error() -> None:
    row = Row(input_ids=np.arange(6), loss_mask=np.array([0, 0, 1, 1, 0, 1], dtype=np.int8),
              logprobs=np.full(6, np.nan, dtype=np.float32), advantage=0.5, group_id="g", session_id="s")
    counts = RowCounts()
    with pytest.raises(ValueError, match="passed over"):
        to_verl([row], counts=counts, min_group_sessions=1)
    assert counts.rows_without_logprobs == 1
