"""Models: finding GGUF files, the embedded default, inspection and stage artifacts."""
