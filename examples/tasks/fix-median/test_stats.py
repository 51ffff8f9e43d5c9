import unittest

from stats import median


class MedianTest(unittest.TestCase):
    def test_odd(self) -> None:
        self.assertEqual(median([3, 1, 2]), 2)

    def test_even(self) -> None:
        self.assertEqual(median([4, 1, 3, 2]), 2.5)


if __name__ == "__main__":
    unittest.main()
