"""Start `llmserve run` as a real subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(path: str) -> bool:
    """Whether a server listens on the Unix socket at `path`."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


def terminate(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM `proc` and wait for it; SIGKILL it if it is still running after `timeout`."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ServerProcess:
    """`llmserve run MODEL ARGS...` bound to 127.0.0.1; `stop()` ends it. `ca`: the served
    certificate (ARGS serve HTTPS): `url` is then https, and `verify` checks against it.
    `uds`: served on that Unix socket instead (`--uds`); `http()` gives a client that reaches
    it either way."""

    def __init__(self, model: str | None, *args: str, env: dict | None = None,
                 ready_timeout: float = 240.0, ca: str | None = None, uds: str | None = None) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"{'https' if ca else 'http'}://{'localhost' if uds else '127.0.0.1:' + str(self.port)}"
        self.verify = ssl.create_default_context(cafile=ca) if ca else True
        self.uds = uds
        cmd = [sys.executable, "-m", "llmserve.cli", "run"]
        if model is not None:
            cmd.append(model)
        # NOTE: one torch thread: the test process and the server share 2 cores.
        place = ["--uds", uds] if uds else ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd += [*place, "--threads", "1", *args]
        full_env = {**os.environ, "LLMSERVE_LOG_LEVEL": "WARNING", **(env or {})}
        self.log_path = f"/tmp/llmserve-test-{self.port}.log"   # (the port names the log under --uds too)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            # (nobody holds this object to stop it: a failed start must not leave a server behind)
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.logs()}")
            # (httpcore leaks the socket of a Unix connection that fails: try our own first)
            if self.uds and not _accepts(self.uds):
                time.sleep(0.25)
                continue
            try:
                with self.http(timeout=2) as client:
                    if client.get("/ready").status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.logs()}")

    def http(self, **kwargs) -> httpx.Client:
        """An httpx client of this server (`base_url` its URL; over its socket under `uds`)."""
        transport = httpx.HTTPTransport(uds=self.uds, verify=self.verify) if self.uds else None
        return httpx.Client(base_url=self.url, transport=transport, verify=self.verify, **kwargs)

    def logs(self, whole: bool = False) -> str:
        """The server's output: its last 5000 characters (for an assertion's message), or
        `whole`."""
        self._log.flush()
        with open(self.log_path, "rb") as f:
            text = f.read().decode(errors="replace")
        return text if whole else text[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            terminate(self.proc)
        self._log.close()


def tiny_template_server(tmp_path_factory, name: str, template: str) -> ServerProcess:
    """A tiny random Llama (room for 2048 tokens: tool definitions render long in its
    tokenizer) served as "tiny" with `template` as its chat template."""
    from tiny import build_tiny_llama

    folder = build_tiny_llama(tmp_path_factory.mktemp(f"tiny-{name}"), max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("tpl") / f"{name}.jinja"
    path.write_text(template)
    return ServerProcess(str(folder), "--served-model-name", "tiny", "--chat-template", str(path),
                         "--num-kv-blocks", "400")
