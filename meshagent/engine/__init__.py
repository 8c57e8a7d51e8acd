"""Inference engines behind one interface (`base.py`): a whole model on llama.cpp (`llama.py`,
over the model and context of `runtime.py`), a stage's layers (`stage.py`, its output copied out
by the hook of `native.py`) and a whole pipeline of stages in one process
(`split_in_process.py`). Beside them: vocabularies, grammar-constrained sampling, closing JSON
before the token limit, embeddings, and the check that an engine computes draft windows exactly.
The numpy reference engine, for tests and benchmarks, is `meshagent.testing.numpy_ref`.
"""
