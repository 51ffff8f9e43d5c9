"""The event contract: every event and API model, the topic registry, and the codecs.

Everyone imports this package; it imports no other rollwire package.
"""

from schemas.arrays import Logprobs, LossMask, PackedArray, TokenIds
from schemas.codec import EVENT_MODELS, EVENT_TYPES, EventDecodeError, decode_event, encode_event
from schemas.completions import Completion
from schemas.dead_letter import DeadLetter
from schemas.envelope import Event
from schemas.evaluations import Evaluation
from schemas.groups import Group
from schemas.sessions import SessionEnded, SessionSpec, SessionStageChanged
from schemas.tasks import TaskAccepted, TaskRequest
from schemas.topics import Topic, TopicRegistry, TopicSpec
from schemas.trajectories import Trajectory

__all__ = [
    "EVENT_MODELS", "EVENT_TYPES", "Completion", "DeadLetter", "Evaluation", "Event", "EventDecodeError",
    "Group", "Logprobs", "LossMask", "PackedArray", "SessionEnded", "SessionSpec", "SessionStageChanged",
    "TaskAccepted", "TaskRequest", "TokenIds", "Topic", "TopicRegistry", "TopicSpec", "Trajectory",
    "decode_event", "encode_event",
]
