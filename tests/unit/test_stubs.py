"""The hand-written `_core.pyi` must match the built extension."""

import subprocess
import sys


def test_stubtest_passes():
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "llmserve._core", "--ignore-missing-stub"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
