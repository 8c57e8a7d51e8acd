"""Whether an agent may propose a plan (`placement/quorum.py`)."""

from __future__ import annotations

from meshagent.placement.quorum import cut_off


def test_a_single_crash_is_planned_around_at_once():
    assert cut_off(alive=2, lost=1, burst=1, latest=1) is None  # one of three
    assert cut_off(alive=1, lost=1, burst=1, latest=1) is None  # one of two


def test_deaths_in_a_burst_wait_for_the_view_to_stop_shrinking():
    why = cut_off(alive=50, lost=3, burst=3, latest=1)
    assert why is not None and "3 agents died or came within 10 s" in why
    assert cut_off(alive=50, lost=3, burst=3, latest=0) is None  # quiet for 3 s


def test_the_small_side_of_a_cut_proposes_nothing_until_the_window_passes():
    why = cut_off(alive=5, lost=55, burst=0, latest=0)
    assert why is not None and "sees 5 agents where 60 were alive" in why
    assert cut_off(alive=5, lost=0) is None  # a minute on: the lost are forgotten
