"""`meshagent models certify`: staged against whole per wire dtype, a report, a signed record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshagent.certify.checks import CutResult, default_cuts
from meshagent.certify.report import wire_results
from meshagent.cli.main import main
from meshagent.config import DataDir
from meshagent.models.capability import CapabilityStore
from meshagent.models.family import family_traits
from meshagent.models.layout import inspect_model
from meshagent.testing.tiny_gguf import FAMILIES, write_tiny_jamba, write_tiny_model

QUICK = ["--tokens", "4", "--ctx-size", "96", "--threads", "1", "--no-soak"]


def certify(model, data_dir, *extra):
    return main(
        ["models", "certify", str(model), "--json", "--data-dir", str(data_dir), *QUICK, *extra]
    )


def test_default_cuts_are_two_and_three_stages_and_every_type_boundary():
    assert default_cuts(30) == ((0, 15, 30), (0, 10, 20, 30))
    assert default_cuts(6, (1, 2, 4)) == (
        (0, 3, 6),
        (0, 2, 4, 6),
        (0, 1, 6),
        (0, 2, 6),
        (0, 4, 6),
    )


def test_a_dtype_is_exact_only_if_every_cut_gave_the_whole_models_output():
    good = CutResult((0, 2, 4), "f16", positions=10, agree=10)
    bad = CutResult((0, 1, 4), "f16", positions=10, agree=9)
    f32 = CutResult((0, 2, 4), "f32", positions=10, agree=10)
    (w16, w32) = wire_results([good, bad, f32], ("f16", "f32"))
    assert (w16.dtype, w16.exact, w16.top1_agreement) == ("f16", False, 0.95)
    assert w32.exact
    chunk = CutResult((0, 2, 4), "f32", positions=10, agree=10, chunked_identical=False)
    assert not wire_results([chunk], ("f32",))[0].exact


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_certify_writes_a_report_and_a_signed_record(tmp_path, capsys, family):
    # Every family the stage engine runs, each with its own tiny model.
    path = FAMILIES[family](tmp_path / f"tiny-{family}.gguf")
    arch = inspect_model(path).architecture
    assert certify(path, tmp_path / "dd") == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert "whole model: chat" in out.err  # progress, on stderr
    record = report["record"]
    traits = family_traits(inspect_model(path))
    assert record["architecture"] == arch
    assert record["state_kind"] == traits.state_kind
    assert tuple(record["layer_types"]) == traits.layer_types
    cuts = {tuple(r["cut"]) for r in report["results"]}
    assert cuts == set(default_cuts(6, traits.type_boundaries))
    # At f32 a split computes exactly what the whole model computes, for every family.
    f32 = [r for r in report["results"] if r["dtype"] == "f32"]
    assert all(r["max_logit_diff"] == 0.0 and r["greedy_identical"] for r in f32)
    assert "f32" in [w["dtype"] for w in record["wire"] if w["exact"]]
    # The record is stored signed, and verifies as the one the report shows.
    store = CapabilityStore(DataDir(tmp_path / "dd").artifacts_path / "capabilities")
    signed = store.get(record["model_sha256"])
    assert signed is not None and json.loads(json.dumps(signed.record.to_dict())) == record
    md = list((tmp_path / "dd" / "certifications").glob("*.md"))
    assert len(md) == 1 and "| cut | wire |" in md[0].read_text()


def test_certify_refuses_a_family_the_stage_engine_cannot_run(tmp_path, capsys):
    path = tmp_path / "tiny-sliding.gguf"
    write_tiny_model(path, "llama", sliding_window=16)
    assert certify(path, tmp_path / "dd") != 0
    assert "cannot certify" in capsys.readouterr().err


def test_certify_checks_the_cuts_asked_for(tmp_path, capsys):
    path = write_tiny_model(tmp_path / "tiny.gguf", "qwen3")
    assert certify(path, tmp_path / "dd", "--cut", "0:1:6", "--wire-dtype", "f16") == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["cut"], r["dtype"]) for r in report["results"]] == [([0, 1, 6], "f16")]
    assert certify(path, tmp_path / "dd", "--cut", "0:7") != 0
    assert "--cut 0:7" in capsys.readouterr().err
    assert np.isfinite(report["results"][0]["max_logit_diff"])


def test_models_list_and_inspect_show_the_record(tmp_path, capsys):
    path = write_tiny_jamba(tmp_path / "tiny-jamba.gguf")
    dd = ["--data-dir", str(tmp_path / "dd")]
    assert main(["models", "inspect", str(path), *dd]) == 0
    out = capsys.readouterr().out
    assert "split          not yet:" in out and "certified      no record" in out
    assert certify(path, tmp_path / "dd", "--cut", "0:2:6", "--wire-dtype", "f32") == 0
    capsys.readouterr()
    assert main(["models", "inspect", str(path), *dd]) == 0
    out = capsys.readouterr().out
    assert "split          yes: certified" in out
    assert "certified      exact with f32 up to" in out
    assert main(["models", "inspect", str(path), "--json", *dd]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["state_kind"] == "hybrid" and info["capability"]["architecture"] == "jamba"
    assert main(["models", "list", "--json", *dd]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["model_name"] for r in listed["capabilities"]] == ["tiny-jamba"]
    assert {a["kind"] for a in listed["artifacts"]} == {"entry", "layers"}
    assert main(["models", "list", *dd]) == 0
    assert "record   tiny-jamba" in capsys.readouterr().out


def test_certify_smollm2_writes_a_report_and_a_signed_record(model_path, store, tmp_path, capsys):
    # Short settings (the default run takes minutes): one cut, two tokens per prompt. The data
    # dir shares the session's artifact cache, so slices other tests cut are not cut again.
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "artifacts").symlink_to(store.root)
    args = ["--tokens", "2", "--ctx-size", "128", "--cut", "0:10:20:30"]
    assert certify(model_path, tmp_path / "dd", *args) == 0
    report = json.loads(capsys.readouterr().out)
    record = report["record"]
    assert record["model_name"] == model_path.name.removesuffix(".gguf")
    assert record["architecture"] == "llama" and record["state_kind"] == "kv"
    f32 = next(w for w in record["wire"] if w["dtype"] == "f32")
    assert f32["exact"] and f32["max_logit_diff"] == 0.0
    f16 = next(w for w in record["wire"] if w["dtype"] == "f16")
    assert f16["max_logit_diff"] > 0.0  # f16 rounds the residual stream
    records = CapabilityStore(DataDir(tmp_path / "dd").artifacts_path / "capabilities")
    assert records.get(record["model_sha256"]) is not None
    # The shared cache must not hand a record to other tests' agents.
    records.path_of(record["model_sha256"]).unlink()


def test_the_soak_serves_the_split_over_three_agents_as_one_whole_agent(tmp_path, capsys):
    path = write_tiny_jamba(tmp_path / "tiny-jamba.gguf")
    args = ["--tokens", "4", "--ctx-size", "96", "--threads", "1", "--cut", "0:2:6"]
    args += ["--wire-dtype", "f32", "--json", "--data-dir", str(tmp_path / "dd")]
    assert main(["models", "certify", str(path), *args]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    soak = report["soak"]
    assert soak["passed"], soak
    assert soak["wire_dtype"] == "f32" and len(soak["stages"]) == 3
    # 5 prompts (the context-filling one aside), streamed and not, on each of 3 agents.
    assert soak["requests"] == 30 and soak["identical"] == 30
    f32 = next(w for w in report["record"]["wire"] if w["dtype"] == "f32")
    assert f32["soak_identical"] is True and f32["exact"]
    assert "soak: split" in out.err
