import sys

sys.path.insert(0, "/app")

from fizzbuzz import fizzbuzz  # noqa: E402


def test_multiples_of_fifteen() -> None:
    assert [fizzbuzz(n) for n in (15, 30, 45)] == ["FizzBuzz"] * 3


def test_the_others() -> None:
    assert [fizzbuzz(n) for n in (1, 3, 5, 7, 9, 10)] == ["1", "Fizz", "Buzz", "7", "Fizz", "Buzz"]
