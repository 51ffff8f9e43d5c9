import unittest

from text import slugify


class SlugifyTest(unittest.TestCase):
    def test_lower_case(self) -> None:
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_punctuation(self) -> None:
        self.assertEqual(slugify("  Fix: the   Bug! "), "fix-the-bug")


if __name__ == "__main__":
    unittest.main()
