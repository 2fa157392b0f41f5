"""`speculor serve --ray` started as a user starts it (a process of its own, which starts Ray), with tiny models saved
as folders: it serves the direct server's answer through the openai client, and SIGTERM drains it and stops Ray."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from support.server import save_tiny_pair

pytest.importorskip("ray")

from speculor import SamplingConfig, Speculor, load_pair  # noqa: E402

PORT, METRICS_PORT = 18_111, 18_112


def ray_processes() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "ServeReplica:speculor" in " ".join(p.info["cmdline"] or [])]


def test_serve_ray_command_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    target, draft = save_tiny_pair(tmp_path)
    cmd = [sys.executable, "-m", "speculor.cli", "serve", "--ray", "--target", str(target), "--draft", str(draft),
           "--strategy", "chain", "--k", "3", "--threads", "1", "--max-batch", "2", "--port", str(PORT),
           "--metrics-port", str(METRICS_PORT)]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "speculor serve --ray did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model="x", prompt="def add(a, b):", max_tokens=20, temperature=0,
                                           stream=True)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        sp = Speculor(load_pair(str(target), str(draft), threads=1), strategy="chain", k=3)
        assert text == sp.generate("def add(a, b):", SamplingConfig(max_new_tokens=20)).text
        assert ray_processes()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert not ray_processes()
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], capture_output=True)
        log.close()


def test_ray_options_need_ray() -> None:
    out = subprocess.run([sys.executable, "-m", "speculor.cli", "serve", "--replicas", "2"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "--replicas is a Ray Serve option: add --ray" in out.stderr
