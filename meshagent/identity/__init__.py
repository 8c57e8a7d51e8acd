"""Node identity (ed25519 keys, peer ids) and mesh membership."""
