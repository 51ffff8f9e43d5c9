from intervals import length, overlaps


def test_length():
    assert length((3, 5)) == 3


def test_disjoint():
    assert not overlaps((0, 1), (2, 3))


def test_nested():
    assert overlaps((0, 10), (2, 3))
