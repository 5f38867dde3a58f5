"""Running a checks script of Triton kernels on the CPU, through Triton's interpreter.

Triton reads TRITON_INTERPRET when it is imported, so each `tests/*_checks.py` runs in a
subprocess with TRITON_INTERPRET=1: under this interpreter when it has Triton (the test extra
installs it), else under $TANDEM_TRITON_PYTHON (a Python with torch and Triton). Without either,
the tests that use it are skipped with the reason (`NEEDS_TRITON`).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def triton_python() -> str | None:
    if importlib.util.find_spec("triton") is not None:
        return sys.executable
    return os.environ.get("TANDEM_TRITON_PYTHON")


NEEDS_TRITON = pytest.mark.skipif(
    triton_python() is None, reason="needs Triton for its CPU interpreter (CPU builds of torch ship without it): "
    "install triton, or set TANDEM_TRITON_PYTHON to a Python that has it")


def run_checks(script: str, checks: int) -> None:
    """Run tests/<script> under the interpreter; it must exit 0 having printed `checks` "name: ok" lines.
    Then every kernel variant it launched goes through Triton's code generator, as on a GPU
    (tests/triton_record.py, tests/triton_frontend.py): the interpreter alone accepts code that a GPU
    compile rejects."""
    path = os.pathsep.join([str(TESTS.parent), str(TESTS)])
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
        proc = subprocess.run([triton_python(), str(TESTS / "triton_record.py"), record, str(TESTS / script)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count(": ok") == checks, proc.stdout
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": path}
        front = subprocess.run([triton_python(), str(TESTS / "triton_frontend.py"), record], env=env,
                               capture_output=True, text=True, timeout=600)
        assert front.returncode == 0, front.stdout + front.stderr
        assert "frontend: ok" in front.stdout, front.stdout
