"""One import name of our own, for good: nothing we install collides with another distribution.

transformers 5.25 started importing Hugging Face's ``kernels`` package, whose import name was
also ours: from the repository root ours shadowed theirs (transformers failed to import), from
anywhere else theirs shadowed ours. Everything now lives under ``tokenrelay``; these tests hold
that (pyproject.toml's mapping, the namespace portion ``kernels/``, the wheel) from the
repository root and from elsewhere, with Hugging Face's ``kernels`` installed.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.import_boundaries import OURS, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _our_folders() -> set[str]:
    """Every folder of the design's packages that holds Python files, as its tokenrelay name."""
    names = {"tokenrelay"}
    for top in OURS:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.parent.relative_to(ROOT).parts
            if "__pycache__" not in rel:
                names.add(".".join(("tokenrelay", *rel)))
    return names


def test_every_folder_of_ours_is_packaged_under_tokenrelay():
    assert set(SETUPTOOLS["packages"]) == _our_folders()
    assert SETUPTOOLS["package-dir"] == {"tokenrelay": "tokenrelay",
                                         **{f"tokenrelay.{top}": top for top in OURS}}
    assert PYPROJECT["project"]["scripts"] == {"tokenrelay": "tokenrelay.cli:console"}


def test_kernels_is_a_namespace_portion_so_it_never_shadows_hugging_faces():
    """A regular package named ``kernels`` in the current directory would win over the
    installed one for every process started from the repository root."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "kernels" / "ops.py").is_file()


def test_no_import_name_we_install_belongs_to_another_distribution():
    ours = importlib.metadata.distribution("tokenrelay")
    top_level = {name for name, dists in importlib.metadata.packages_distributions().items()
                 if "tokenrelay" in dists}
    assert top_level == {"tokenrelay"}, top_level
    owners = set(importlib.metadata.packages_distributions().get("tokenrelay", []))
    assert owners == {ours.metadata["Name"]}, owners


_KERNELS_AND_TRANSFORMERS = textwrap.dedent("""
    import json, sys
    import torch
    import kernels as hf_kernels                     # Hugging Face's, imported by transformers
    from transformers import AutoModelForCausalLM
    from tokenrelay.kernels import ops
    from tokenrelay.kernels.reference import rms_norm_ref
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = model(ids).logits
    x, w = torch.randn(4, 64), torch.randn(64)
    err = (ops.rms_norm(x, w, 1e-6) - rms_norm_ref(x, w, 1e-6)).abs().max().item()
    print(json.dumps({"hf_kernels": hf_kernels.__file__, "ops": ops.__file__,
                      "logits": list(logits.shape), "err": err}))
""")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["repository root", "another directory"])
def test_transformers_and_our_triton_kernels_in_one_process(where, tiny_checkpoint, tmp_path):
    pytest.importorskip("kernels", reason="Hugging Face's kernels package is not installed")
    pytest.importorskip("triton")
    cwd = ROOT if where == "repository root" else tmp_path
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", _KERNELS_AND_TRANSFORMERS,
                           str(tiny_checkpoint("llama"))], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    import json
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "site-packages" in out["hf_kernels"], out
    assert Path(out["ops"]).resolve() == (ROOT / "kernels" / "ops.py").resolve()
    assert out["logits"][:2] == [1, 3]
    assert out["err"] < 1e-4


def _lock_pin(name: str) -> str:
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.lower().startswith(f"{name.lower()}=="):
            return line.strip()
    raise AssertionError(f"requirements.lock pins no {name}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_wheel_installs_beside_hugging_faces_kernels(tmp_path):
    """The built wheel, in a fresh venv next to Hugging Face's ``kernels`` (the lock's versions):
    ``pip check`` clean, no file of one inside the other's folder, and ``tokenrelay worker
    --help`` working from the repository root and from elsewhere."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "requirements.lock"):
        shutil.copy(ROOT / name, src / name)
    for top in ("tokenrelay", *OURS):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(src)], check=True, timeout=180, cwd=tmp_path)
    [wheel] = wheels.glob("tokenrelay-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-c", str(ROOT / "requirements.lock"), str(wheel), _lock_pin("kernels")],
                   check=True, timeout=300)
    check = subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert (site / "kernels" / "__init__.py").is_file()            # Hugging Face's
    assert (site / "tokenrelay" / "kernels" / "ops.py").is_file()  # ours, under our name
    assert not (site / "tokenrelay" / "kernels" / "__init__.py").exists()
    for cwd in (ROOT, tmp_path):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([str(venv / "bin" / "tokenrelay"), "worker", "--help"], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "--model" in done.stdout
        where = subprocess.run([str(py), "-c", "import tokenrelay.worker, kernels; "
                                "print(tokenrelay.worker.__file__); print(kernels.__file__)"],
                               cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        assert where.returncode == 0, where.stderr[-2000:]
        ours, hf = where.stdout.split()
        assert hf.startswith(str(site)), hf
        if cwd != ROOT:   # from the root, `python -c` puts the checkout first, as for any project
            assert ours.startswith(str(site)), ours
