"""The thresholds of the assignment's rules (`assignment.py`, `chain_rules.py`; the reasons
in docs/placement.md, "Many models": the numbers came from its simulation)."""

GROW_AT = 1.0  # recent demand past what the replicas serve adds replicas,
GROW_TO = 0.5  # as many as bring it under this share (and shrinking stops there too)
SHRINK_AT = 0.2  # replicas go when the rest would serve the settled demand under this
SETTLED = 0.25  # demand has settled: the recent and the whole window this close
MIN_REPLICA = 0.15  # a replica added must serve this share of what the model had at least
CLOSE = 0.10  # among peers this close to the fastest, one that served it or holds its file
# What a model is counted to get at least of a peer's compute, however busy the other models
# there are: peers serve their models' requests side by side, each gets a share.
FAIR_SHARE = 0.5
RECLAIM = 1.5  # a peer others' spare replicas hold is taken when this much better
STANDBY = 1  # chains a pinned split keeps beyond what demand asks, where memory holds them
