"""bench/device_check.sh on a machine without a GPU: it says so and exits before it builds or
installs anything; with a GPU listed but no CUDA compiler, it says what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"


BASH = shutil.which("bash") or "/bin/bash"


def run(path: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path, "CUDA_HOME": str(tmp_path / "no-cuda")}
    return subprocess.run(
        [BASH, str(SCRIPT), "--out", str(tmp_path / "out"), "--venv", str(tmp_path / "venv")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def bin_with(tmp_path: Path, nvidia_smi: str | None) -> str:
    """A PATH of the basic tools, and a stand-in `nvidia-smi` printing `nvidia_smi`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("grep", "dirname", "realpath", "sed", "tail", "mkdir", "cat"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nprintf '%s' '{nvidia_smi}'\n")
        fake.chmod(0o755)
    return str(bin_dir)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_it_says_so_and_installs_nothing(tmp_path):
    r = run(bin_with(tmp_path, None), tmp_path)
    assert r.returncode == 3, r.stderr
    assert "no NVIDIA GPU on this machine" in r.stderr
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()


def test_a_driver_that_lists_no_gpu_is_no_gpu(tmp_path):
    r = run(bin_with(tmp_path, "No devices were found\n"), tmp_path)
    assert r.returncode == 3 and "no NVIDIA GPU" in r.stderr


def test_a_gpu_without_a_cuda_compiler_is_told_what_to_install(tmp_path):
    r = run(bin_with(tmp_path, "GPU 0: NVIDIA H200 (UUID: GPU-0)\n"), tmp_path)
    assert r.returncode == 4, r.stderr
    assert "GPU 0: NVIDIA H200" in r.stderr and "install the CUDA toolkit" in r.stderr
    assert not (tmp_path / "venv").exists()


def test_help_lists_the_steps_and_options():
    r = subprocess.run([BASH, str(SCRIPT), "--help"], capture_output=True, text=True, check=True)
    for word in ("CUDA", "stage-parity", "whole", "split", "--wheels", "exits 3"):
        assert word in r.stdout
