"""net-sim: hosts in network namespaces joined by a userspace link emulator.

`net-sim/` is not a package itself (its name has a hyphen); scripts and tests put it on
`sys.path` and import `netsim`.
"""
