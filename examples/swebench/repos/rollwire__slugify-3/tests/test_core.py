from slugify import slugify


def test_spaces():
    assert slugify("hello world") == "hello-world"


def test_punctuation():
    assert slugify("a, b!") == "a-b"
