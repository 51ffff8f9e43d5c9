from textstats import line_count, word_count


def test_single_word():
    assert word_count("hello") == 1


def test_sentence():
    assert word_count("the quick brown fox") == 4


def test_line_count():
    assert line_count("one\ntwo\n") == 2
