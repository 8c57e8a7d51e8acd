"""`--model` names: paths stay paths, hub names are parsed, and a repository's file is
chosen by quantisation with an error that lists the choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshagent.errors import ModelError
from meshagent.models.names import HubName, choose_file, parse_model_name

FILES = [
    "README.md",
    "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf",
    "Qwen2.5-0.5B-Instruct-Q8_0.gguf",
    "big/Qwen2.5-0.5B-Instruct-F16-00001-of-00002.gguf",
    "big/Qwen2.5-0.5B-Instruct-F16-00002-of-00002.gguf",
]


def test_paths_stay_paths(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert parse_model_name(str(model)) == model
    assert parse_model_name("./models/x.gguf") == Path("./models/x.gguf")
    assert parse_model_name("missing.gguf") == Path("missing.gguf")


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", HubName("Qwen/Qwen2.5-0.5B-Instruct-GGUF")),
        (
            "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0",
            HubName("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Q8_0"),
        ),
        ("org/repo/sub/file.gguf", HubName("org/repo", file="sub/file.gguf")),
    ],
)
def test_hub_names_are_parsed(spec, name):
    assert parse_model_name(spec) == name
    assert str(name) == spec


@pytest.mark.parametrize("spec", ["just-a-word", "a/b/c", "org/repo:Q4:x", "-x/y"])
def test_what_is_neither_is_refused(spec):
    with pytest.raises(ModelError, match="neither a GGUF file here nor"):
        parse_model_name(spec)


def test_a_quantisation_picks_its_file_in_any_case():
    repo = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
    assert choose_file(HubName(repo, "q8_0"), FILES) == "Qwen2.5-0.5B-Instruct-Q8_0.gguf"
    # A split file is named by its first part.
    assert choose_file(HubName(repo, "F16"), FILES) == FILES[3]
    assert choose_file(HubName(repo, file=FILES[1]), FILES) == FILES[1]


def test_ambiguous_and_missing_choices_say_what_there_is():
    repo = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
    with pytest.raises(ModelError, match="ambiguous: name one of F16, Q4_K_M, Q8_0"):
        choose_file(HubName(repo), FILES)
    with pytest.raises(ModelError, match="no Q2_K file; its quantisations: F16, Q4_K_M, Q8_0"):
        choose_file(HubName(repo, "Q2_K"), FILES)
    with pytest.raises(ModelError, match="holds no GGUF file"):
        choose_file(HubName("org/repo"), ["README.md"])
    assert choose_file(HubName("org/one"), ["x/Model.Q4_1.gguf"]) == "x/Model.Q4_1.gguf"
