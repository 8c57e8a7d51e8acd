import json

from meshagent.cli.main import main


def test_models_inspect_reports_layers_and_kv(tmp_path, capsys):
    assert main(["models", "inspect", "--json", "--data-dir", str(tmp_path)]) == 0
    layout = json.loads(capsys.readouterr().out)
    assert layout["architecture"] == "llama"
    assert layout["layers"] == 30
    assert len(layout["layer_bytes"]) == 30
    # SmolLM2: 3 KV heads x 64 dims, K and V, f16.
    assert layout["kv_bytes_per_token_per_layer"] == 2 * 3 * 64 * 2
    assert layout["splittable"] is True


def test_models_slice_caches_by_content(tmp_path, capsys):
    args = ["models", "slice", "--layers", "20-30", "--json", "--data-dir", str(tmp_path)]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["role"] == "last"
    assert (first["start"], first["end"]) == (20, 30)
    assert main(args) == 0  # cached: same artifact, not cut again
    second = json.loads(capsys.readouterr().out)
    assert second["sha256"] == first["sha256"]
    assert second["path"] == first["path"]
    assert main(["models", "list", "--json", "--data-dir", str(tmp_path)]) == 0
    listed = json.loads(capsys.readouterr().out)["artifacts"]
    assert [m["sha256"] for m in listed] == [first["sha256"]]


def test_models_slice_refuses_a_bad_range(tmp_path, capsys):
    assert main(["models", "slice", "--layers", "5:99", "--data-dir", str(tmp_path)]) == 1
    assert "5-99 is outside this model's 0-30" in capsys.readouterr().err
    assert main(["models", "slice", "--layers", "oops", "--data-dir", str(tmp_path)]) == 1
    assert "A-B" in capsys.readouterr().err


def test_models_inspect_says_what_experts_cost(tmp_path, capsys):
    from meshagent.testing.tiny_gguf import N_EXPERTS, N_EXPERTS_USED, write_tiny_model

    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", n_layers=2)
    assert main(["models", "inspect", str(path), "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"experts        {N_EXPERTS} a layer, {N_EXPERTS_USED} a token" in out
    assert main(["models", "inspect", str(path), "--json", "--data-dir", str(tmp_path)]) == 0
    layout = json.loads(capsys.readouterr().out)
    assert (layout["experts"], layout["experts_used"]) == (N_EXPERTS, N_EXPERTS_USED)
    assert layout["layer_params"][0] < layout["layer_bytes"][0] // 4  # f32: 4 bytes a weight


def test_models_inspect_of_a_hub_name_reads_its_header_only(tmp_path, capsys, monkeypatch):
    # A model of realistic proportions (weights far bigger than the header), on a local hub:
    # inspecting it by name fetches the header by range, not the file.
    from meshagent.testing.tiny_gguf import write_tiny_model
    from tests.models.fake_hub import FakeHub

    model = write_tiny_model(
        tmp_path / "big-Q8_0.gguf", "qwen3", n_layers=8, n_embd=256, n_head=8, n_ff=1024
    )
    hub = FakeHub({"org/big-GGUF": {model.name: model.read_bytes()}})
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        args = ["models", "inspect", "org/big-GGUF:Q8_0", "--data-dir", str(tmp_path / "dd")]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "architecture   qwen3" in out and "layers         8" in out
        assert "split          yes" in out and "file           " in out
        assert 0 < hub.served < model.stat().st_size / 100, (hub.served, model.stat().st_size)
    finally:
        hub.close()
