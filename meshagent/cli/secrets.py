"""Secrets `meshagent up` is given (API keys, an invite token, which carries the mesh secret),
read from a file, the environment or standard input so that they stay out of the process list,
where every user of the machine can read a command's arguments. A value on the command line
still works, with a warning that says where it shows."""

from __future__ import annotations

import getpass
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from meshagent.config import API_KEY_ENV, JOIN_ENV
from meshagent.errors import ConfigError

STDIN = "-"  # the value of --api-key or --join that reads it from standard input

API_KEY_FIX = f"--api-key-file PATH, ${API_KEY_ENV} or --api-key - (standard input)"
JOIN_FIX = f"--join - (standard input), --join-file PATH or ${JOIN_ENV}"


@dataclass(frozen=True)
class Exposed:
    """A secret given as a command-line value: which flag, and what to use instead."""

    flag: str
    fix: str


@dataclass(frozen=True)
class Secrets:
    api_keys: tuple[str, ...]  # from --api-key and the environment (not the config's)
    join: str | None  # the invite token, if any
    exposed: tuple[Exposed, ...]  # secrets that were on the command line


def read_key_file(path: Path | str) -> tuple[str, ...]:
    """The API keys in a key file: one per line, blank lines ignored."""
    keys = tuple(line.strip() for line in _read(Path(path), "API key").splitlines())
    keys = tuple(k for k in keys if k)
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key (one key per line)")
    return keys


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the {what} file {path}: {e.strerror or e}") from None


def _read_stdin(what: str) -> str:
    if sys.stdin is None:
        raise ConfigError(f"{what} from standard input ('-'), but there is no standard input")
    if sys.stdin.isatty():  # a person types or pastes it: not echoed
        return getpass.getpass(f"{what}: ")
    return sys.stdin.read()


def gather(
    *,
    api_keys: list[str] | None,
    api_key_file: str | None,
    join: str | None,
    join_file: str | None,
    environ: Mapping[str, str],
    read_stdin: Callable[[str], str] = _read_stdin,
) -> Secrets:
    """The secrets of `up`'s flags and environment. A value of `-` reads standard input
    (only one flag may); an API key file's keys are added to the others; `--join` and
    `--join-file` exclude each other, and either wins over $MESHAGENT_JOIN."""
    flags = list(api_keys or [])
    if flags.count(STDIN) + (join == STDIN) > 1:
        raise ConfigError(
            "only one secret can come from standard input: give the others with "
            f"--api-key-file or ${API_KEY_ENV}, --join-file or ${JOIN_ENV}"
        )
    exposed: list[Exposed] = []
    keys: list[str] = []
    for value in flags:
        if value == STDIN:
            given = [k.strip() for k in read_stdin("API key").splitlines() if k.strip()]
            if not given:
                raise ConfigError("--api-key -: standard input held no key")
            keys += given
        else:
            keys.append(value)
            exposed.append(Exposed("--api-key", API_KEY_FIX))
    if api_key_file:
        keys += read_key_file(api_key_file)
    if environ.get(API_KEY_ENV):
        keys.append(environ[API_KEY_ENV])
    if join is not None and join_file is not None:
        raise ConfigError("give the invite token once: --join or --join-file, not both")
    token = None
    if join == STDIN:
        token = read_stdin("invite token")
    elif join is not None:
        token = join
        exposed.append(Exposed("--join", JOIN_FIX))
    elif join_file is not None:
        token = _read(Path(join_file), "invite token")
    elif environ.get(JOIN_ENV):
        token = environ[JOIN_ENV]
    if token is not None and not token.strip():
        raise ConfigError("the invite token is empty")
    return Secrets(tuple(keys), token, tuple(dict.fromkeys(exposed)))
