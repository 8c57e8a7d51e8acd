"""The `nat` scenario's tally and table from hand-made runs (no root)."""

from netsim import nat_matrix


def run(direct_s=None, punches=1, why=None):
    return {"direct_s": direct_s, "punches": punches, "why": why, "path": None}


def test_pairs_are_each_unordered_pair_once():
    assert nat_matrix.pairs(("none", "full-cone", "symmetric")) == [
        ("none", "none"),
        ("none", "full-cone"),
        ("none", "symmetric"),
        ("full-cone", "full-cone"),
        ("full-cone", "symmetric"),
        ("symmetric", "symmetric"),
    ]


def test_a_pair_counts_direct_runs_and_those_within_the_goal():
    recs = [run(2.0), run(3.0, punches=2), run(12.0, punches=3), run(None, 4, "no candidate")]
    s = nat_matrix.summarise(recs)
    assert (s["runs"], s["direct"], s["within_goal"]) == (4, 3, 2)
    assert s["share_within_goal"] == 0.5
    assert (s["direct_s_median"], s["direct_s_max"]) == (3.0, 12.0)
    assert s["punches_median"] == 2.5 and s["relayed_why"] == ["no candidate"]
    out = {"regime": "wan", "runs_per_pair": 4, "cap_s": 20, "pairs": {"a/b": s}}
    row = nat_matrix.table(out).splitlines()[-1]
    assert row == "| a/b | 3/4 | 2/4 | 3.0, 12.0 | 2.5 | no candidate |"
