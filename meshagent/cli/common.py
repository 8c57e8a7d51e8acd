"""Flags and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import httpx

from meshagent.cli.secrets import read_key_file
from meshagent.config import API_KEY_ENV, DataDir, default_data_dir, parse_size
from meshagent.errors import ConfigError, MeshError


def add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        metavar="PATH",
        type=Path,
        default=None,
        help="where the identity, config and caches live "
        "(default: $MESHAGENT_DATA_DIR or the platform's user data dir)",
    )


def data_dir_from(args: argparse.Namespace) -> DataDir:
    return DataDir(args.data_dir or default_data_dir())


class NoAgent(MeshError):
    pass


def agent_url(args: argparse.Namespace) -> str:
    """The local agent's API: `--api` where the command has it, else what the running agent
    of the data dir wrote; NoAgent when none runs."""
    url = getattr(args, "api", None)
    if url:
        return str(url)
    dd = data_dir_from(args)
    try:
        return str(json.loads(dd.run_path.read_text())["api"])
    except (OSError, ValueError, KeyError):
        raise NoAgent(
            f"no agent is running for data dir {dd.root} (start one with `meshagent up`)"
        ) from None


def control_get(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """GET a control endpoint of the local agent, with a clear error when none runs."""
    return control_call(args, "GET", path)


def control_call(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    timeout: float | None = 5.0,
) -> dict[str, Any]:
    """Ask a control endpoint of the local agent (`timeout`: seconds to wait for its answer,
    None for as long as it takes). NoAgent when none answers; an answer of 400 or more is a
    MeshError with the agent's message."""
    dd = data_dir_from(args)
    url = agent_url(args)
    try:
        r = httpx.request(
            method,
            f"{url}{path}",
            json=body,
            headers=auth_headers(dd),
            timeout=httpx.Timeout(timeout, connect=5.0),
        )
    except httpx.HTTPError as e:
        raise NoAgent(f"the agent at {url} does not answer ({e}); is it running?") from e
    if r.status_code == 401:
        raise NoAgent(
            f"the agent at {url} needs an API key: set ${API_KEY_ENV}, or api_key_file "
            f"(or api_keys) in {dd.config_path}"
        )
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code >= 400:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise MeshError(message or f"the agent at {url} answered {r.status_code} to {path}")
    if not isinstance(answer, dict):
        raise NoAgent(f"the agent at {url} answered {path} with no JSON object")
    return answer


def auth_headers(dd: DataDir) -> dict[str, str]:
    """The key a client of the local agent sends: ${API_KEY_ENV}, else the first of the
    data dir's `api_keys`, else the first in its `api_key_file`; none if none is set."""
    key = os.environ.get(API_KEY_ENV)
    if not key:
        try:
            config = dd.load_config()
            keys = list(config.get("api_keys") or [])
            if not keys and config.get("api_key_file"):
                keys = list(read_key_file(str(config["api_key_file"])))
        except MeshError:
            keys = []
        key = str(keys[0]) if keys else ""
    return {"authorization": f"Bearer {key}"} if key else {}


def size_arg(text: str) -> int:
    """Bytes from `4MiB`, `500k`, `1048576`...: every size option takes the same units."""
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
