"""Where `meshagent up` takes its secrets from: an API key and an invite token from a file,
the environment or standard input, so that they stay out of the process list; a value on the
command line still works, and is named as exposed."""

from __future__ import annotations

import pytest

from meshagent.cli.main import build_parser
from meshagent.cli.secrets import JOIN_ENV, gather, read_key_file
from meshagent.config import API_KEY_ENV
from meshagent.errors import ConfigError

TOKEN = "meshinv1exampletoken"


def up_args(*argv: str):
    return build_parser().parse_args(["up", *argv])


def secrets_of(*argv: str, environ=None, stdin: str | None = None):
    args = up_args(*argv)
    asked: list[str] = []

    def read_stdin(what: str) -> str:
        asked.append(what)
        assert stdin is not None, "standard input was read"
        return stdin

    found = gather(
        api_keys=args.api_keys,
        api_key_file=args.api_key_file,
        join=args.join,
        join_file=args.join_file,
        environ=environ or {},
        read_stdin=read_stdin,
    )
    return found, asked


def test_keys_and_the_token_from_files_are_not_exposed(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("first-key\n\n  second-key  \n")
    token = tmp_path / "invite"
    token.write_text(TOKEN + "\n")
    found, asked = secrets_of("--api-key-file", str(keys), "--join-file", str(token))
    assert found.api_keys == ("first-key", "second-key")
    assert found.join.strip() == TOKEN
    assert found.exposed == () and asked == []


def test_secrets_from_the_environment_are_not_exposed():
    found, _ = secrets_of(environ={API_KEY_ENV: "env-key", JOIN_ENV: TOKEN})
    assert found.api_keys == ("env-key",) and found.join == TOKEN and found.exposed == ()


def test_the_token_and_a_key_from_standard_input():
    found, asked = secrets_of("--join", "-", stdin=TOKEN + "\n")
    assert found.join.strip() == TOKEN and asked == ["invite token"] and found.exposed == ()
    found, asked = secrets_of("--api-key", "-", stdin="stdin-key\n")
    assert found.api_keys == ("stdin-key",) and asked == ["API key"]


def test_values_on_the_command_line_still_work_and_are_named_as_exposed():
    found, _ = secrets_of("--api-key", "k1", "--api-key", "k2", "--join", TOKEN)
    assert found.api_keys == ("k1", "k2") and found.join == TOKEN
    flags = {e.flag: e.fix for e in found.exposed}
    assert set(flags) == {"--api-key", "--join"}
    assert "--api-key-file" in flags["--api-key"] and "--join -" in flags["--join"]


def test_a_join_flag_wins_over_the_environment():
    found, _ = secrets_of("--join", "-", environ={JOIN_ENV: "other"}, stdin=TOKEN)
    assert found.join == TOKEN


@pytest.mark.parametrize(
    ("argv", "stdin", "message"),
    [
        (("--api-key", "-", "--join", "-"), "x", "only one secret can come from standard input"),
        (("--join", TOKEN, "--join-file", "f"), None, "--join or --join-file, not both"),
        (("--api-key", "-"), "\n", "standard input held no key"),
        (("--join", "-"), "  \n", "the invite token is empty"),
        (("--api-key-file", "/nonexistent/keys"), None, "cannot read the API key file"),
    ],
)
def test_what_cannot_be_used_is_refused_with_the_reason(argv, stdin, message):
    with pytest.raises(ConfigError, match=message):
        secrets_of(*argv, stdin=stdin)


def test_an_empty_key_file_is_refused(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("\n \n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_key_file(empty)
