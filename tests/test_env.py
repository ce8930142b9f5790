"""Every HPCDL_* variable: one parser (hpcdl/env.py), its documented values, one error."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.comm import base
from hpcdl.debug import log
from hpcdl.env import (
    VARIABLES,
    EnvVarError,
    check_environment,
    env_count,
    env_flag,
    env_seconds,
    markdown_table,
)
from hpcdl.errors import BadInputError

ROOT = Path(__file__).resolve().parents[1]
#: set only by tests and their harnesses, never by a user (removed from the trainer elsewhere)
@pytest.mark.parametrize("value", ["0", "no", "NO", "false", "FALSE", "off", ""])
def test_hpcdl_debug_off_means_off_in_the_communicator_and_the_log(monkeypatch, value):
    monkeypatch.setenv("HPCDL_DEBUG", value)
    assert base.debug_enabled() is False
    assert log.debug_enabled() is False


@pytest.mark.parametrize("value", ["1", "yes", "TRUE", "on"])
def test_hpcdl_debug_on_means_on_in_the_communicator_and_the_log(monkeypatch, value):
    monkeypatch.setenv("HPCDL_DEBUG", value)
    assert base.debug_enabled() is True
    assert log.debug_enabled() is True


def test_an_undocumented_flag_value_is_bad_input_naming_variable_and_value():
    with pytest.raises(BadInputError, match=r"HPCDL_DEBUG='maybe': expected 1/true/yes/on or "
                                            r"0/false/no/off"):
        env_flag("HPCDL_DEBUG", {"HPCDL_DEBUG": "maybe"})


@pytest.mark.parametrize("name,value", [("HPCDL_STALL_WARN_S", "soon"),
                                        ("HPCDL_STALL_ABORT_S", "-1"),
                                        ("HPCDL_DUMP_EVERY_S", "nan"),
                                        ("HPCDL_RANKS_PER_NODE", "0"),
                                        ("HPCDL_RANKS_PER_NODE", "two"),
                                        ("HPCDL_COMM_YIELD", "sometimes"),
                                        ("HPCDL_DUMP", "2")])
def test_every_kind_refuses_values_outside_its_documented_ones(name, value):
    with pytest.raises(EnvVarError, match=re.escape(f"{name}={value!r}")):
        check_environment({name: value})


def test_defaults_come_from_the_table():
    assert env_seconds("HPCDL_STALL_ABORT_S", {}) == 600.0
    assert env_count("HPCDL_RANKS_PER_NODE", {}) is None
    assert env_flag("HPCDL_DUMP", {}) is False
    check_environment({})


def test_a_command_given_a_bad_variable_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HPCDL_DEBUG": "maybe"}
    out = subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "doctor", "--mpi-flavor"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("hpcdl doctor: HPCDL_DEBUG='maybe': expected"), out.stderr


def test_docs_show_the_table_the_module_parses():
    text = (ROOT / "docs" / "debugging.md").read_text()
    shown = text.split("<!-- env-table start -->\n", 1)[1].split("\n<!-- env-table end -->")[0]
    assert shown == markdown_table(), "regenerate: python3 -c 'import hpcdl.env as e; " \
                                      "print(e.markdown_table())'"


def test_every_variable_the_code_reads_is_in_the_table():
    named = set()
    for folder in ("hpcdl", "data_prep", "slurm"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".sbatch") and path.is_file():
                named.update(re.findall(r"HPCDL_[A-Z_]*[A-Z]", path.read_text()))
    unknown = sorted(n for n in named if n not in VARIABLES)
    assert unknown == [], f"add these to hpcdl.env.VARIABLES: {unknown}"
