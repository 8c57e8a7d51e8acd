"""The mesh's catalogue of models: signed entries (`entry.py`), the book that merges them
(`book.py`), kept on disk (`book_file.py`), what an agent reads of a model it adds
(`model_file.py`), and the catalogue one agent takes part in over gossip (`service.py`)."""
