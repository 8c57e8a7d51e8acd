"""Catalogue entries for the tests: a small model's add, a removal, signed by whom is asked."""

from __future__ import annotations

from meshagent.catalog.entry import CatalogEntry, SignedEntry
from meshagent.identity.keys import NodeIdentity

T0 = 1_700_000_000  # a unix time
SHA = "ab" * 32


def add_entry(name: str = "tiny-llama", version: int = 1, time: int = T0, **fields) -> CatalogEntry:
    values = {
        "source": "org/repo:Q4_K_M",
        "sha256": SHA,
        "size": 12_345_678,
        "architecture": "llama",
        "n_layers": 4,
        "layer_bytes": (1000, 1000, 1000, 1200),
        "embedding_bytes": 5000,
        "head_bytes": 5100,
        "other_bytes": 64,
        "kv_bytes_per_token_per_layer": 512,
        "flops_per_layer": 2.5e6,
        "tied_embeddings": False,
        "split_refusal": None,
        "n_embd": 64,
        "n_vocab": 259,
        "tokenizer_bytes": 4096,
        **fields,
    }
    return CatalogEntry(name=name, op="add", version=version, time=time, **values)


def signed_add(
    who: NodeIdentity, name: str = "tiny-llama", version: int = 1, time: int = T0, **fields
) -> SignedEntry:
    return add_entry(name, version, time, **fields).sign(who)


def signed_remove(
    who: NodeIdentity, name: str = "tiny-llama", version: int = 2, time: int = T0
) -> SignedEntry:
    return CatalogEntry.remove(name, version=version, time=time).sign(who)
