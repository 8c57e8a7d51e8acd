import stat

import pytest

from meshagent.config import PREFIX_CACHE_AUTO, AgentConfig, DataDir, prefix_budget
from meshagent.errors import ConfigError
from meshagent.identity.keys import NodeIdentity


def test_data_dir_is_created_once_with_a_private_identity(tmp_path):
    dd = DataDir(tmp_path / "d")
    dd.ensure()
    ident, created = NodeIdentity.load_or_create(dd.identity_path)
    assert created
    assert stat.S_IMODE(dd.identity_path.stat().st_mode) == 0o600
    again, created = NodeIdentity.load_or_create(dd.identity_path)
    assert not created
    assert again.peer_id == ident.peer_id
    assert dd.config_path.read_text().startswith("# meshagent")


def test_identity_readable_by_others_is_refused(tmp_path):
    ident = NodeIdentity.generate()
    path = tmp_path / "identity.key"
    ident.save(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        NodeIdentity.load(path)


def test_config_file_then_flags_override_defaults(tmp_path):
    dd = DataDir(tmp_path)
    dd.config_path.write_text("api_port = 9999\nslots = 2\n")
    cfg = AgentConfig().merged(dd.load_config()).merged({"slots": 3, "api_host": None})
    assert (cfg.api_port, cfg.slots, cfg.api_host) == (9999, 3, "127.0.0.1")


@pytest.mark.parametrize("bad", [{"nonsense": 1}, {"api_port": "x"}])
def test_bad_config_keys_and_types_are_refused(bad):
    with pytest.raises(ConfigError):
        AgentConfig().merged(bad)


def test_validation_explains_itself(tmp_path):
    with pytest.raises(ConfigError, match="slots"):
        AgentConfig(slots=0).validate()
    with pytest.raises(ConfigError, match="draft-model: no GGUF file at"):
        AgentConfig(draft_model=str(tmp_path / "missing.gguf")).validate()


@pytest.mark.parametrize(
    ("timers", "why"),
    [
        ({"suspect_after": 0.5}, "interval < suspect_after < dead_after"),
        ({"dead_after": 400.0}, "within 300 s"),
    ],
)
def test_gossip_timers_the_gossip_service_would_refuse_are_refused_by_the_config(timers, why):
    with pytest.raises(ConfigError, match=why):
        AgentConfig(**timers).validate()


def test_broken_config_file_names_the_file(tmp_path):
    dd = DataDir(tmp_path)
    dd.config_path.write_text("api_port = = 3")
    with pytest.raises(ConfigError, match=r"config\.toml"):
        dd.load_config()


@pytest.mark.parametrize(
    ("given", "want"), [("300M", 300_000_000), ("1.5G", 1_500_000_000), (1 << 20, 1 << 20)]
)
def test_max_memory_is_parsed_once_into_bytes(tmp_path, given, want):
    dd = DataDir(tmp_path)
    dd.config_path.write_text(f"max_memory = {given!r}\n".replace("'", '"'))
    assert AgentConfig().merged(dd.load_config()).max_memory == want
    assert AgentConfig().merged({"max_memory": given}).max_memory == want


def test_a_bad_max_memory_is_refused_with_its_value_named():
    with pytest.raises(ConfigError, match=r"max-memory: '300X' is not a size"):
        AgentConfig().merged({"max_memory": "300X"})
    with pytest.raises(ConfigError, match="max-memory must be >= 0"):
        AgentConfig().merged({"max_memory": -1}).validate()


@pytest.mark.parametrize(
    ("given", "want"),
    [("auto", PREFIX_CACHE_AUTO), ("0", 0), ("off", 0), ("200M", 200_000_000), (0, 0)],
)
def test_prefix_cache_is_a_size_auto_or_off(given, want):
    assert AgentConfig().prefix_cache == PREFIX_CACHE_AUTO
    assert AgentConfig().merged({"prefix_cache": given}).prefix_cache == want
    with pytest.raises(ConfigError, match=r"prefix-cache: 'lots' is not a size"):
        AgentConfig().merged({"prefix_cache": "lots"})


def test_the_prefix_cache_takes_only_what_the_plan_leaves_free():
    gib = 1 << 30
    # auto: a quarter of the offer at most, and never what the model's part needs
    assert prefix_budget(PREFIX_CACHE_AUTO, offered=8 * gib, needed=2 * gib) == 2 * gib
    assert prefix_budget(PREFIX_CACHE_AUTO, offered=8 * gib, needed=7 * gib) == gib
    assert prefix_budget(PREFIX_CACHE_AUTO, offered=gib, needed=2 * gib) == 0
    assert prefix_budget(3 * gib, offered=8 * gib, needed=6 * gib) == 2 * gib
    assert prefix_budget(gib // 2, offered=8 * gib, needed=gib) == gib // 2
    assert prefix_budget(0, offered=8 * gib, needed=gib) == 0


def test_many_models_settings():
    c = AgentConfig().merged({"model": "a.gguf"})  # config.toml's one-model key
    assert c.models == ("a.gguf",)
    c = AgentConfig().merged({"models": ["a.gguf", "b.gguf"], "pins": ["b"]})
    assert c.models == ("a.gguf", "b.gguf") and c.pins == ("b",)
    assert AgentConfig().keep_alive_seconds() == 300.0
    assert AgentConfig().merged({"keep_alive": "1h30m"}).keep_alive_seconds() == 5400.0
    assert AgentConfig().merged({"keep_alive": "-1"}).keep_alive_seconds() == -1.0
    for bad in ({"keep_alive": "soon"}, {"load_timeout": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(bad)).replace("_", "-")):
            AgentConfig().merged(bad).validate()


def test_the_config_template_names_every_key_commented_out_and_each_parses():
    # docs/cli.md: config.toml is created with every key commented out.
    import re
    import tomllib
    from dataclasses import fields

    from meshagent.config import CONFIG_TEMPLATE, AgentConfig

    lines = re.findall(r"^# (\w+ = .*)$", CONFIG_TEMPLATE, re.MULTILINE)
    named = {line.split(" =")[0] for line in lines}
    assert named == {f.name for f in fields(AgentConfig)}
    # Each line, uncommented, is a setting the agent takes.
    for line in lines:
        setting = tomllib.loads(line.split("  #")[0])
        AgentConfig().merged(setting)
