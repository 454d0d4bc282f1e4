"""`llmserve run`'s process set-up: the OpenMP spin default is set before torch loads (it is
read once, when libgomp loads), and never over what the environment already says."""

from __future__ import annotations

import subprocess
import sys

from llmserve import cli


def test_the_cli_module_does_not_load_torch():
    code = "import sys, llmserve.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_short_openmp_spin_respects_the_environment(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli._short_openmp_spin()
    assert cli.os.environ["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    cli._short_openmp_spin()
    assert cli.os.environ["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    cli._short_openmp_spin()
    assert "GOMP_SPINCOUNT" not in cli.os.environ
