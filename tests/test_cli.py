"""The command-line entry point: every command imports and the CPU main job runs."""
import importlib
import os
import subprocess
import sys

import pytest

from megamoe.cli import COMMANDS, build_parser


@pytest.mark.parametrize("module_name", [name for name, _ in COMMANDS])
def test_every_command_module_imports_and_registers(module_name):
    module = importlib.import_module(f"megamoe.commands.{module_name}")
    assert callable(module.register)


def test_help_lists_all_commands():
    text = build_parser().format_help()
    for name, _ in COMMANDS:
        assert name.replace("_", "-") in text
    assert "unavailable" not in text


def test_readme_commands_are_the_ones_ci_runs():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().splitlines()
    for marker, must_contain in (("# main job", "python -m megamoe generate"), ("# tests", "python -m pytest")):
        line = readme[readme.index(marker) + 1]
        assert must_contain in line
    assert "'^# tests$'" in (root / ".ci" / "run").read_text()


def test_generate_runs_on_cpu_default_in_under_a_minute():
    # the CPU job even on a GPU machine (there the default is the V4-Flash-sized GPU job, minutes long)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "megamoe", "generate"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "ms/token" in result.stdout and "tokens of request 0" in result.stdout


def test_moe_layer_job_runs_on_cpu_default():
    # as a user runs it: without the interpreter the test-suite switched on (and the CPU job on a GPU machine too)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "megamoe", "run"], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "relative error" in result.stdout
