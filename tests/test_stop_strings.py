"""Stop strings are found across token boundaries and never emitted."""

from lucebox.text.stopping import StopStrings


def feed_all(stops, pieces):
    s = StopStrings(stops)
    out = []
    for piece in pieces:
        text, stopped = s.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + s.flush(), False


def test_stop_string_split_over_pieces_is_not_emitted():
    assert feed_all(["END"], ["abc E", "N", "D tail"]) == ("abc ", True)


def test_partial_match_is_held_back_then_released():
    s = StopStrings(["END"])
    assert s.feed("abc EN") == ("abc ", False)
    assert s.feed("x") == ("ENx", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(["bb", "a"], ["xxbba"]) == ("xx", True)


def test_no_stops_passes_everything():
    assert feed_all([], ["a", "b"]) == ("ab", False)


def test_text_without_stop_is_all_released_at_the_end():
    assert feed_all(["STOP"], ["ST", "O", "x"]) == ("STOx", False)
