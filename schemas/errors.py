"""The one exception root of the contract package: what reading, writing or sending an event can raise.

```
SchemaError
├── ArrayCodecError      a packed token or logprob array is malformed (also ValueError)
├── EventDecodeError     a record is not an event this consumer can take (also ValueError)
└── TransportError       talking to Kafka failed (schemas.transport.errors: publish, closed client, topics)
```
"""


class SchemaError(Exception):
    """Base class for failures of the event contract's codecs and Kafka clients."""
