"""The README's quick start is exactly two command lines, and CI runs the second verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_quick_start_has_two_command_lines():
    lines = quick_start_commands()
    assert len(lines) == 2
    assert lines[0].endswith("meshagent up")
    assert "pytest" in lines[1]


def test_ci_runs_the_readme_test_line():
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r'^TEST_LINE="(.*)"$', ci, re.M)
    assert m is not None
    line = m.group(1).replace('\\"', '"').replace("\\$", "$")  # as the shell reads it
    assert line == quick_start_commands()[1]
