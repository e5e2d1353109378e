"""The wheels a GPU machine lacks, carried in a folder: it has torch, triton and transformers
preinstalled and can fetch nothing, so ``make gpu-wheels`` downloads the rest here first.

    python -m benchmarks.gpu_wheels download .gpu-wheels [--python 3.12] [--no-model]
    python -m benchmarks.gpu_wheels missing .gpu-wheels      # what an install would add here

Standard library only: it runs before anything it installs can be imported. The list comes
from pyproject.toml (the base install, the ``worker``, ``embedded`` and ``fetch`` extras),
less what the machine brings; the wheel of ``tokenrelay fetch smollm2`` travels too
(93 MB; ``--no-model`` leaves it out), so the check can build SmolLM2 without a registry.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
EXTRAS = ("worker", "embedded", "fetch")
# On the GPU machine already, in versions we do not choose: never downloaded or installed.
PREINSTALLED = {"torch", "triton", "transformers", "tokenizers", "safetensors", "numpy",
                "huggingface-hub"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The project's requirements a worker on the GPU machine needs, less the preinstalled."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"].get(extra, [])
    seen: dict[str, str] = {}
    for req in reqs:
        name = _name(req)
        if name not in PREINSTALLED and name not in seen:
            seen[name] = req
    return list(seen.values())


def model_wheel() -> str:
    """``package==version`` of the registry package ``engine.fetch smollm2`` reads."""
    text = (REPO / "engine" / "fetch.py").read_text()
    match = re.search(r'"smollm2":\s*Source\("([^"]+)",\s*"([^"]+)"', text)
    if not match:
        raise RuntimeError("engine/fetch.py no longer names the smollm2 package")
    return f"{match.group(1)}=={match.group(2)}"


def _requires(wheel: Path, python: str) -> list[str]:
    """A wheel's own requirements (not its extras') whose markers hold on the GPU machine."""
    import zipfile
    from email.parser import Parser

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = Parser().parsestr(zf.read(meta).decode()).get_all("Requires-Dist") or []
    env = {"python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
    try:
        from packaging.requirements import Requirement
    except ImportError:                  # keep what has no marker
        return [r for r in reqs if ";" not in r]
    return [r for r in reqs
            if Requirement(r).marker is None or Requirement(r).marker.evaluate(env)]


def download(dest: Path, python: str = "3.12", with_model: bool = True) -> int:
    """``pip download`` the wheels (binary only) for CPython ``python`` on manylinux x86_64,
    one package at a time without dependencies, following each wheel's requirements except the
    preinstalled ones: accelerate requires torch, and a plain ``pip download`` would bring
    torch's CUDA wheels (gigabytes) the machine already has."""
    dest.mkdir(parents=True, exist_ok=True)
    abi = "cp" + python.replace(".", "")
    target = ["--no-deps", "--only-binary=:all:", "--python-version", python,
              "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        target += ["--platform", platform]
    queue, seen = list(requirements()), set()
    while queue:
        req = queue.pop(0)
        name = _name(req)
        if name in seen or name in PREINSTALLED:
            continue
        seen.add(name)
        before = set(dest.glob("*.whl"))
        code = subprocess.call([sys.executable, "-m", "pip", "download", "-q", "--dest",
                                str(dest), *target, req])
        if code != 0:
            return code
        wheel = _wheel_of(dest, name, before)
        queue += _requires(wheel, python)
    if with_model:
        code = subprocess.call([sys.executable, "-m", "pip", "download", "-q", "--dest",
                                str(dest), *target, model_wheel()])
        if code != 0:
            return code
    size = sum(f.stat().st_size for f in dest.glob("*.whl")) / 2**20
    print(f"{len(list(dest.glob('*.whl')))} wheels, {size:.0f} MiB in {dest}")
    return 0


def _wheel_of(dest: Path, name: str, before: set[Path]) -> Path:
    """The wheel just downloaded for ``name`` (or the one already there)."""
    stem = name.replace("-", "_").lower()
    new = [w for w in set(dest.glob("*.whl")) - before]
    for w in new + sorted(dest.glob("*.whl")):
        if w.name.lower().split("-")[0] == stem:
            return w
    raise RuntimeError(f"pip download left no wheel of {name} in {dest}")


def missing(reqs: Optional[list[str]] = None) -> list[str]:
    """The requirements this interpreter does not satisfy (absent, or a version outside the
    range; without the ``packaging`` module only absence is seen)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from packaging.requirements import Requirement
    except ImportError:
        Requirement = None
    out = []
    for req in requirements() if reqs is None else reqs:
        parsed = Requirement(req) if Requirement is not None else None
        if parsed is not None and parsed.marker is not None and not parsed.marker.evaluate():
            continue
        try:
            have = version(_name(req))
        except PackageNotFoundError:
            out.append(req)
            continue
        if parsed is not None and not parsed.specifier.contains(have, prereleases=True):
            out.append(req)
    return out


def install_missing(wheels: Path) -> tuple[list[str], str]:
    """Install what is missing from ``wheels`` with ``--no-index`` (nothing is fetched);
    returns (what was missing, pip's last line or "" when nothing was)."""
    need = missing()
    if not need:
        return [], ""
    if not wheels.is_dir():
        raise RuntimeError(f"missing {', '.join(need)} and no wheel folder {wheels}: run "
                           f"`make gpu-wheels` where a registry answers and copy {wheels} along")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
           *need]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 and "externally-managed" in done.stderr:
        # a distribution's Python (PEP 668): we only add packages, never replace its own
        done = subprocess.run(cmd + ["--break-system-packages"], capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install {', '.join(need)} from {wheels}: "
                           f"{done.stderr.strip()[-600:]}")
    return need, last


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_wheels",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="pip download the wheels into DIR")
    dl.add_argument("dir", type=Path)
    dl.add_argument("--python", default="3.12", help="the GPU machine's CPython (default 3.12)")
    dl.add_argument("--no-model", action="store_true", help="leave out the SmolLM2 wheel")
    ms = sub.add_parser("missing", help="list what this interpreter lacks")
    ms.add_argument("dir", type=Path, nargs="?")
    args = ap.parse_args(argv)
    if args.command == "download":
        return download(args.dir, args.python, not args.no_model)
    for req in missing():
        print(req)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
