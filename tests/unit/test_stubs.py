"""The hand-written `_core.pyi` must match the built extension."""

import os
import subprocess
import sys

CONFIG = os.path.join(os.path.dirname(__file__), "stubtest.ini")


def test_stubtest_passes():
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "llmserve._core", "--ignore-missing-stub",
                        "--mypy-config-file", CONFIG], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
