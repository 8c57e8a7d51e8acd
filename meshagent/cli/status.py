"""`meshagent status`: what the local agent is and serves."""

from __future__ import annotations

import argparse
import json

from meshagent.cli.common import add_data_dir, control_get
from meshagent.wording import layer_range, not_served, peer_label, size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show the local agent's identity and what it serves")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument(
        "--api", metavar="URL", help="the agent's API URL (default: read from the data dir)"
    )
    add_data_dir(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    st = control_get(args, "/control/status")
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    # Peers by the names their users gave them (the peers document has them).
    rows = control_get(args, "/control/peers").get("peers") or []
    names = {r["peer_id"]: r.get("name") or "" for r in rows}
    names[st["peer_id"]] = st.get("name") or ""

    def label(peer_id: str) -> str:
        return peer_label(peer_id, names)

    print(f"peer id   {st['peer_id']}")
    print(f"name      {st['name']}")
    print(f"version   {st['version']}")
    print(f"mesh      {st['mesh']}")
    print(f"state     {st['state']}  (in flight: {st['in_flight']})")
    access = st.get("api_access") or {}
    keys = access.get("keys", 0)
    if keys:
        guard = f"{keys} key{'s' if keys > 1 else ''}"
    elif access.get("loopback_host_only"):
        guard = "no key, loopback only"
    else:
        guard = "NO KEY, reachable beyond loopback"
    print(f"api       {st['api']}/v1  ({guard})")
    print(f"listen    {', '.join(st['listen']) or '-'}")
    if st.get("alone"):
        print(f"ALONE     {st['alone']}")
    if "advertised" in st:
        print(f"addresses {', '.join(st['advertised']) or '-'}  (advertised to peers)")
    for r in st.get("relays", []):
        state = (
            f"registered, {len(r['members'])} mesh members there"
            if r["registered"]
            else (f"not registered ({r['error'] or 'connecting'})")
        )
        seen = f"; sees us from {r['observed']}" if r.get("observed") else ""
        print(f"relay     {r['address']}  {state}{seen}")
    reach = st.get("reachability")
    if reach and st.get("relays"):
        public = (
            f"; public {', '.join(reach['public'] or reach['public_hosts'])}"
            if (reach["public"] or reach["public_hosts"])
            else ""
        )
        print(f"nat       {reach['said']}{public}")
    mdns = st.get("mdns")
    if mdns:
        others = sum(not s["same_mesh"] for s in mdns["seen"])
        seen = f", {len(mdns['seen'])} agents seen ({others} of other meshes)"
        print(f"mdns      {mdns['note']}{seen if mdns['enabled'] else ''}")
    g = st.get("gossip")
    if g:
        states = ", ".join(f"{n} {k}" for k, n in sorted(g["states"].items()))
        print(
            f"gossip    {states}; {g['protocol']}, {g['timers']}; "
            f"{g['exchanges']} exchanges, {g['bytes_sent']} bytes sent"
        )
    for m in st["models"]:
        s = m["slots"]
        print(
            f"model     {m['id']}  layers {m['layers'][0]}-{m['layers'][1]}  "
            f"slots {s['active']}/{s['slots']} busy, {s['queued']} queued"
        )
        spec = m.get("speculation")
        if spec:
            exact = "exact" if spec["exact_windows"] else "not exact"
            print(f"speculation {spec['default']} by default; windows {exact}: {spec['reason']}")
        if s.get("draft_windows"):
            share = s["draft_accepted"] / max(1, s["draft_tokens"])
            print(
                f"drafts    {s['draft_windows']} windows, {s['draft_accepted']} of "
                f"{s['draft_tokens']} draft tokens accepted ({share:.0%}): that many steps saved"
            )
        if draft := (spec or {}).get("draft_model"):
            forward = draft["forward_ms"]
            took = "not timed yet" if forward is None else f"{forward:.1f} ms a forward pass"
            share = s.get("model_accepted", 0) / max(1, s.get("model_tokens", 0))
            print(
                f"draft     {draft['name']}: {took} ({draft['cost_in_steps']:.2f} steps); "
                f"{s.get('model_windows', 0)} windows, {s.get('model_accepted', 0)} of "
                f"{s.get('model_tokens', 0)} draft tokens accepted ({share:.0%})"
            )
        cost = (spec or {}).get("window_cost") or {}
        if steps := cost.get("steps"):
            one = steps.get("1")
            ones = f"{one['count']}, {one['mean_ms']:.1f} ms each" if one else "none"
            print(
                f"steps     {sum(x['count'] for x in steps.values())} decode steps timed ({ones} "
                f"of one token); a window of n tokens costs 1 + {cost['jump']:.2f} + "
                f"{cost['slope']:.2f} x (n - 1) one-token steps, as learnt now"
            )
        cache = m.get("prefix_cache")
        if cache:
            print(
                f"prefixes  {cache['reason']}; {s.get('prefix_entries', 0)} kept, "
                f"{size(s.get('prefix_bytes', 0))} of {size(cache['budget_bytes'])}; "
                f"{s.get('prefix_hits', 0)} hits, {s.get('prefix_misses', 0)} misses, "
                f"{s.get('prefix_tokens', 0)} prompt tokens not prefilled"
            )
    routing = st.get("routing") or {}
    routed = sum(routing.get(k, 0) for k in ("prefix", "balance", "new"))
    if routed:
        print(
            f"routing   {routed} requests among replicas: {routing['prefix']} to the one "
            f"holding their conversation, {routing['new']} new, {routing['balance']} moved "
            f"off a busy one; {routing['remembered']} remembered"
        )
    for m in st.get("assignment") or []:
        if m.get("loading"):
            where = f"loading: {m['loading']}"
        elif m["placed"]:
            where = f"placed on {', '.join(label(x) for x in m['peers'])}"
        else:
            where = f"not placed: {m['why_not'] or 'being decided'}"
        pin = "pinned" if m["pinned"] else ""
        if not m["pinned"] and m["unloads_in_s"] is not None and m["placed"]:
            pin = f"unloads in {m['unloads_in_s']:.0f} s"
        demand = (
            f"{m['tokens_per_s']:.1f} tok/s, {m['requests_per_min']:.1f} req/min, "
            f"{m['in_flight']} in flight"
        )
        extras = "; ".join(x for x in (demand, pin, "" if m["here"] else "no part here") if x)
        print(f"model     {m['model']}  {where} ({extras})")
    for model_id, p in (st.get("placement") or {}).items():
        if not p.get("routable"):
            loading = [label(x) for x in p.get("loading") or []]
            whose = "its" if len(loading) == 1 else "their"
            waiting = f"waiting for {', '.join(loading)} to load {whose} part" if loading else ""
            why = p.get("error") or waiting or "a plan is being agreed"
            print(f"placement {not_served(model_id, why)}")
        for chain in [p["stages"], *(p.get("chains") or [])] if p.get("stages") else []:
            parts = ", ".join(f"{label(pid)} {layer_range(a, b)}" for pid, a, b in chain)
            print(f"split     {model_id}  {parts}")  # a line per chain
        wire = p.get("wire")
        if wire:
            exact = "certified exact" if wire["certified_exact"] else "not certified exact"
            print(f"wire      {wire['dtype']}  {exact}: {wire['reason']}")
    d = st.get("download")
    if d:
        state = "whole, sha256 checked" if d["complete"] else "stage-only"
        hub, peers = size(d["fetched_from_hub_bytes"]), size(d["fetched_from_peers_bytes"])
        print(
            f"download  {d['repo']}/{d['file']}  {state}: {size(d['held_bytes'])} of "
            f"{size(d['size_bytes'])} here; fetched {hub} from the hub, {peers} from peers"
        )
        for key, verdict in sorted(d["artifacts"].items()):
            print(f"  {key}  {verdict}")
        for f in d.get("fetching") or []:
            got = f"{size(f['done_bytes'])} of {size(f['total_bytes'])}"
            got = got if f["total_bytes"] else "starting"
            print(f"  {f['key']}  fetching from {f['source']}: {got}")
    peers = st.get("peers", [])
    print(f"peers     {len(peers)} connected")
    for p in peers:
        rtt = "-" if p["rtt_ms"] is None else f"{p['rtt_ms']:.2f} ms"
        print(f"  {label(p['peer_id'])}  {p['path']:<8} {p['address']:<22} rtt {rtt}")
    return 0
