"""The README's example runs as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_compose_primitives_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compose_primitives.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # also without an editable install
    )
    assert done.returncode == 0, done.stderr
    assert "ok: 4 gradient partitions match plain torch on 2 ranks" in done.stdout


def test_fsdp_blocks_one_device_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fsdp_blocks_one_device.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "host syncs per step [0, 0, 0, 0, 0, 0, 0, 0]" in done.stdout
    assert "fsdp_blocks against plain training: PASS" in done.stdout
