# Common development recipes. `just --list` shows them.

venv := ".venv/bin"

# Start an agent on the embedded default model
up *ARGS:
    {{venv}}/meshagent up {{ARGS}}

# Run the whole test suite
test *ARGS:
    {{venv}}/python -m pytest {{ARGS}}

# Lint and check formatting
lint:
    {{venv}}/ruff check .
    {{venv}}/ruff format --check .

# API decode speed vs llama-cpp-python called directly
bench-serve *ARGS:
    {{venv}}/python bench/serve.py {{ARGS}}
