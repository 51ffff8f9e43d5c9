"""The JSON depth limit at its boundary: exactly the limit passes, one
level more is refused and named, whatever the containers and wherever the deep part sits."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import BadRequest
from proxy.limits import MAX_JSON_DEPTH, check_depth, json_depth_error


def nested(depth: int, shape: str) -> Any:
    """A document whose deepest container is ``depth`` levels down (1: the document itself)."""
    value: Any = "leaf"
    for level in range(depth):
        if shape == "list" or (shape == "mixed" and level % 2):
            value = [1, "x", value]
        else:
            value = {"n": 1, "deeper": value}
    return value


@pytest.mark.parametrize("shape", ["dict", "list", "mixed"])
def test_the_limit_passes_and_one_more_level_is_refused(shape: str) -> None:
    assert json_depth_error(nested(MAX_JSON_DEPTH, shape)) is None
    assert json_depth_error(nested(MAX_JSON_DEPTH + 1, shape)) is not None


def test_the_deep_part_is_found_beside_shallow_siblings_and_named() -> None:
    document = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 50,
                "tools": [{"name": "a", "parameters": {}}, {"name": "b", "parameters": nested(MAX_JSON_DEPTH, "dict")}]}
    assert json_depth_error(document) is not None
    with pytest.raises(BadRequest) as refused:
        check_depth(document)
    assert refused.value.param is not None and refused.value.param.startswith("tools.1.parameters.deeper")
    document["tools"][1]["parameters"] = nested(MAX_JSON_DEPTH - 3, "mixed")
    assert json_depth_error(document) is None
    assert json_depth_error("just a string") is None and json_depth_error([]) is None
