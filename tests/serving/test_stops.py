from hypothesis import given
from hypothesis import strategies as st

from meshagent.serving.stops import StopMatcher

alphabet = st.sampled_from("ab c\n")


def expected(text: str, stops: list[str]) -> str:
    cuts = [text.find(s) for s in stops if s and text.find(s) >= 0]
    return text[: min(cuts)] if cuts else text


@given(
    chunks=st.lists(st.text(alphabet, max_size=6), max_size=12),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
)
def test_streamed_output_is_the_text_up_to_the_first_stop(chunks, stops):
    m = StopMatcher(tuple(stops))
    out = "".join(m.feed(c) for c in chunks) + m.flush()
    text = "".join(chunks)
    assert out == expected(text, stops)
    # The stop that ended it is one found where the text was cut.
    assert (m.matched is not None) == m.stopped
    if m.matched is not None:
        assert text[len(out) :].startswith(m.matched)


@given(chunks=st.lists(st.text(alphabet, max_size=6), max_size=12))
def test_without_stops_text_passes_through_immediately(chunks):
    m = StopMatcher(())
    assert [m.feed(c) for c in chunks] == chunks


def test_partial_stop_is_held_back_then_released():
    m = StopMatcher(("STOP",))
    assert m.feed("hello ST") == "hello "
    assert m.feed("ART") == "START"
    assert m.feed(" and STO") == " and "
    assert m.feed("P now") == ""
    assert m.stopped
    assert m.flush() == ""
