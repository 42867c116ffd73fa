"""The README's example runs as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str) -> subprocess.CompletedProcess[str]:
    """``examples/<name>`` run as a user would, also without an editable install."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_compose_primitives_example_runs() -> None:
    done = run_example("compose_primitives.py")
    assert done.returncode == 0, done.stderr
    assert "ok: 4 gradient partitions match plain torch on 2 ranks" in done.stdout


def test_fsdp_blocks_one_device_example_runs() -> None:
    done = run_example("fsdp_blocks_one_device.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "host syncs per step [0, 0, 0, 0, 0, 0, 0, 0]" in done.stdout
    assert "fsdp_blocks against plain training: PASS" in done.stdout


def test_small_runtime_example_runs() -> None:
    done = run_example("small_runtime.py")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("mlp", "gpt"):
        [line] = [x for x in done.stdout.splitlines() if x.startswith(f"{name}: PerModuleZero3 against DDP on 2 ranks")]
        assert float(line.rsplit(" ", 1)[1]) < 1e-6, line
