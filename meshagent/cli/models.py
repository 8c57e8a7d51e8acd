"""`meshagent models`: inspect GGUF models and cut stage artifacts; the mesh's catalogue
(`add`, `remove`, `catalog`: `cli/catalog.py`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import trio

from meshagent.cli import catalog, certify
from meshagent.cli.common import add_data_dir, data_dir_from
from meshagent.cli.progress import ProgressBar
from meshagent.errors import ConfigError, ModelError
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh_file import load_mesh
from meshagent.models.artifacts import ArtifactStore, SliceManifest
from meshagent.models.capability import CapabilityRecord, CapabilityStore
from meshagent.models.default import resolve_model
from meshagent.models.family import family_traits
from meshagent.models.hub import cached_models, partial_models
from meshagent.models.layout import field, inspect_model, open_gguf
from meshagent.models.names import HubName, parse_model_name
from meshagent.models.transfer import LABEL, fetch_artifact
from meshagent.net.address import Address
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.serving.chat import OWN
from meshagent.serving.family_templates import family_template
from meshagent.wire.handshake import LocalPeer
from meshagent.wording import layer_range, size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="inspect models and cut stage artifacts")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    i = msub.add_parser("inspect", help="layers, bytes per layer, KV cost, whether it splits")
    i.add_argument("model", nargs="?", default="", help="a GGUF file (default: embedded)")
    i.add_argument("--json", action="store_true", help="print the layout as JSON")
    add_data_dir(i)
    i.set_defaults(run=run_inspect)

    s = msub.add_parser("slice", help="cut layers A:B (or the entry artifact) into the cache")
    s.add_argument("model", nargs="?", default="", help="a GGUF file (default: embedded)")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--layers", metavar="A-B", help="the layer range A-B to cut, B exclusive (e.g. 10-20)"
    )
    g.add_argument(
        "--entry", action="store_true", help="the entry artifact: tokenizer and embeddings"
    )
    s.add_argument("--json", action="store_true", help="print the manifest as JSON")
    add_data_dir(s)
    s.set_defaults(run=run_slice)

    f = msub.add_parser("fetch", help="fetch an artifact from a peer of this mesh")
    f.add_argument("key", help="the artifact key (as in `meshagent models list --json`)")
    f.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="HOST:PORT",
        help="the overlay address of a peer that holds it",
    )
    f.add_argument("--sha256", metavar="HEX", help="refuse the artifact unless its sha256 is this")
    add_data_dir(f)
    f.set_defaults(run=run_fetch)

    certify.register(msub)
    catalog.register(msub)

    pull = msub.add_parser("pull", help="download a model by name into the hub's cache")
    pull.add_argument("name", help="ORG/REPO, ORG/REPO:QUANT or ORG/REPO/FILE.gguf")
    pull.set_defaults(run=run_pull)

    ls = msub.add_parser(
        "list",
        help="models downloaded by name, and the stage artifacts and capability records in "
        "the data dir's cache",
    )
    ls.add_argument("--json", action="store_true", help="print the models as JSON")
    add_data_dir(ls)
    ls.set_defaults(run=run_list)


def _capability(model: Path, args: argparse.Namespace) -> CapabilityRecord | None:
    """The record for this model file in the data dir's cache (certified here or learned by
    gossip), if any."""
    store = ArtifactStore(data_dir_from(args).artifacts_path)
    signed = CapabilityStore(store.capabilities_path).get(store.source_sha256(model))
    return None if signed is None else signed.record


def _certified(record: CapabilityRecord) -> str:
    exact = ", ".join(record.exact_dtypes()) or "no wire dtype"
    when = time.strftime("%Y-%m-%d", time.gmtime(record.certified_at))
    return (
        f"exact with {exact} up to {record.certified_ctx} tokens "
        f"(certified {when} by {record.certifier[:12]}, {record.llama_cpp_version})"
    )


def chat_template_name(path: Path) -> str:
    """Which chat template serving renders conversations with: the file's own, or (a file
    without one) its family's (`serving/family_templates.py`)."""
    reader = open_gguf(path)
    if "tokenizer.chat_template" in reader.fields:
        return OWN
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    held = set(tokens.contents()) if tokens is not None else set()
    arch = str(field(reader, "general.architecture", ""))
    return f"{family_template(arch, held.__contains__).name} (the file has none: its family's)"


def _inspected(spec: str, args: argparse.Namespace) -> Path:
    """The file to inspect: a local one, or for a hub name not in the cache its header only
    (a range request into a partial copy under the data dir: the file is not downloaded)."""
    if spec:
        name = parse_model_name(spec)
        if isinstance(name, HubName):
            from meshagent.models.hub import model_for_agent

            return model_for_agent(name, data_dir_from(args).models_path, weights_offer=0)
    return resolve_model(spec)


def run_inspect(args: argparse.Namespace) -> int:
    model = _inspected(args.model, args)
    layout = inspect_model(model)
    traits = family_traits(layout)
    record = _capability(model, args)
    template = chat_template_name(Path(layout.path))
    if args.json:
        print(
            json.dumps(
                {
                    **layout.to_dict(),
                    "state_kind": traits.state_kind,
                    "layer_types": list(traits.layer_types),
                    "chat_template": template,
                    "capability": None if record is None else record.to_dict(),
                },
                indent=2,
            )
        )
        return 0
    print(f"model          {layout.name}  ({layout.path})")
    print(f"architecture   {layout.architecture}")
    print(f"layers         {layout.n_layers}  (embedding length {layout.n_embd})")
    print(f"vocabulary     {layout.n_vocab} tokens")
    print(f"context        {layout.context_length} tokens (trained)")
    print(f"file           {size(layout.file_bytes)}")
    print(f"embeddings     {size(layout.embedding_bytes)}")
    print(f"output head    {size(layout.head_bytes)}")
    sizes = sorted(set(layout.layer_bytes))
    per_layer = size(sizes[0]) if len(sizes) == 1 else f"{size(sizes[0])} - {size(sizes[-1])}"
    print(f"per layer      {per_layer}  ({layout.layer_bytes[0]} bytes for layer 0)")
    if layout.n_experts:
        print(
            f"experts        {layout.n_experts} a layer, {layout.n_experts_used} a token: memory "
            "counts every expert, compute only those a token is routed to"
        )
    kv = layout.kv_bytes_per_token_per_layer
    print(f"KV per token   {kv} bytes per layer, {kv * layout.n_layers} for all layers (f16)")
    print(f"state          {traits.state_kind} per sequence")
    print(f"chat template  {template}")
    if layout.splittable:
        print("split          yes: any contiguous layer range can run as a stage")
    elif traits.certifiable and record is not None:
        print("split          yes: certified (the stage engine runs it; a record allows it)")
    elif traits.certifiable:
        print(f"split          not yet: {layout.split_refusal} (`meshagent models certify`)")
    else:
        print(f"split          no: {layout.split_refusal} (it can still be served whole)")
    if record is not None:
        print(f"certified      {_certified(record)}")
    else:
        print("certified      no record (a split sends f32: `meshagent models certify`)")
    return 0


def _parse_range(text: str, n_layers: int) -> tuple[int, int]:
    """Layers A-B (B exclusive); A:B, the older form, is read too."""
    try:
        a, b = (int(x) for x in text.replace(":", "-", 1).split("-"))
    except ValueError:
        raise ConfigError(f"--layers must look like A-B (e.g. 0-10), got {text!r}") from None
    if not 0 <= a < b <= n_layers:
        raise ConfigError(
            f"--layers {layer_range(a, b)} is outside this model's {layer_range(0, n_layers)}"
        )
    return a, b


def run_slice(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    layout = inspect_model(model)
    store = ArtifactStore(data_dir_from(args).artifacts_path)
    if args.entry:
        path, manifest = store.ensure_entry(model, layout)
    else:
        a, b = _parse_range(args.layers, layout.n_layers)
        path, manifest = store.ensure_layers(model, a, b, layout)
    if args.json:
        print(json.dumps({"path": str(path), **manifest.to_dict()}, indent=2))
        return 0
    print(f"{manifest.kind} artifact {manifest.start}:{manifest.end} ({manifest.role})")
    print(f"path           {path}")
    print(f"sha256         {manifest.sha256}")
    print(f"file           {size(manifest.size_bytes)}, weights {size(manifest.weight_bytes)}")
    print(f"KV per token   {manifest.kv_bytes_per_token_per_layer} bytes per layer")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    if not isinstance(parse_model_name(args.name), HubName):
        raise ModelError(f"'{args.name}' is a local file, not a name on the hub: nothing to pull")
    print(resolve_model(args.name, ProgressBar(f"downloading {args.name}")))
    return 0


def run_list(args: argparse.Namespace) -> int:
    store = ArtifactStore(data_dir_from(args).artifacts_path)
    manifests = store.all()
    records = [s.record for s in CapabilityStore(store.capabilities_path).all()]
    downloaded = cached_models()
    partial = partial_models(data_dir_from(args).models_path)
    if args.json:
        data = {
            "downloaded": [
                {"name": n, "path": str(p), "size_bytes": p.stat().st_size} for n, p in downloaded
            ],
            "partial": [{"path": str(path), **part.status()} for path, part in partial],
            "artifacts": [m.to_dict() for m in manifests],
            "capabilities": [r.to_dict() for r in records],
        }
        print(json.dumps(data, indent=2))
        return 0
    for name, path in downloaded:
        print(f"model    {name}  {size(path.stat().st_size)}")
    for _, part in partial:
        st = part.status()
        state = "whole" if st["complete"] else f"{size(st['held_bytes'])} here (stage-only)"
        print(f"partial  {st['repo']}/{st['file']}  {size(st['size_bytes'])}, {state}")
    for r in records:
        print(f"record   {r.model_name}  {r.model_sha256[:16]}  {_certified(r)}")
    if not manifests:
        print("no stage artifacts cached (cut one with `meshagent models slice`)")
        return 0
    print(f"{'source':<36}{'kind':<8}{'layers':<10}{'role':<8}{'size':>12}  sha256")
    for m in manifests:
        print(
            f"{m.source_name[:35]:<36}{m.kind:<8}{f'{m.start}:{m.end}':<10}{m.role:<8}"
            f"{size(m.size_bytes):>12}  {m.sha256[:16]}"
        )
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    dd = data_dir_from(args)
    if not dd.mesh_path.exists():
        raise ConfigError(f"no mesh in {dd.root}: join one first (`meshagent up --join TOKEN`)")
    mesh = load_mesh(dd.mesh_path)
    store = ArtifactStore(dd.artifacts_path)
    address = Address.parse(args.source)

    async def main() -> tuple[Path, SliceManifest]:
        # A throwaway identity: the agent of this data dir may be running under its own.
        local = LocalPeer.create(NodeIdentity.generate(), mesh)
        node = ConnectionManager(local, TcpTransport())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            conn = await node.dial(address)
            result = await fetch_artifact(
                lambda: conn.open_stream(LABEL),
                args.key,
                store,
                expected_sha256=args.sha256,
                progress=ProgressBar(f"fetch {args.key}"),
            )
            await node.aclose(grace=1.0)
            nursery.cancel_scope.cancel()
        return result

    path, manifest = trio.run(main)
    print(f"fetched {manifest.kind} {manifest.start}:{manifest.end} sha256 {manifest.sha256}")
    print(f"path    {path}")
    return 0
