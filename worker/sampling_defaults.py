"""A model's recommended sampling, applied where a job leaves a field unset.

Checkpoints say how they want to be sampled in ``generation_config.json`` (Qwen3: temperature
0.6, top_p 0.95, top_k 20); vLLM applies those by default (``--generation-config auto``) and
users expect the same answers here. The worker reads them once (``--generation-config``:
``auto`` the checkpoint's, ``vllm`` none, or another folder's; the file is read by
``engine.model_config.generation_defaults``) and fills in, per job, only the fields its
``params`` do not set. A job's own value always wins, so ``temperature: 0`` stays greedy.

Two defaults are bounded by the job rather than merely filled in: ``max_tokens`` (the file's
``max_new_tokens``) is capped to what the context leaves after the prompt, as vLLM caps it
(``worker/admission.py: resolve_max_tokens``), and is not applied below the job's
``min_tokens``; the penalties beam search refuses are not applied to a beam search job.
A value the protocol would refuse (``top_p: 0``) is left out with a warning naming it: the
checkpoint's mistake must not fail every job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import ValidationError

from tokenrelay.engine.model_config import generation_defaults
from tokenrelay.protocol.sampling_params import (NOT_WITH_BEAM_SEARCH, SamplingParams,
                                                 min_tokens_fit)
from tokenrelay.worker.config import WorkerSettings

OFF = "vllm"        # vLLM's word for its own defaults: no generation_config
AUTO = "auto"


@dataclass(frozen=True)
class SamplingDefaults:
    """Field -> default (SamplingParams' names), each valid on its own."""

    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, settings: WorkerSettings, log: Any) -> "SamplingDefaults":
        """The defaults ``--generation-config`` names (WorkerSettings checked the choice);
        none for ``vllm`` or a ``fake:`` engine."""
        folder = _folder(settings)
        if folder is None:
            return cls()
        values = {}
        for name, value in generation_defaults(folder).items():
            try:
                SamplingParams.model_validate({name: value})
            except ValidationError as exc:
                log.warning("generation_config.json: a default the protocol refuses is left "
                            "out", field=name, value=repr(value)[:60],
                            error=exc.errors()[0].get("msg"))
                continue
            values[name] = value
        if values:
            log.info("sampling defaults from generation_config.json", folder=str(folder),
                     **values)
        return cls(values)

    def apply(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with the defaults of the fields they leave unset (``max_tokens`` is
        left to ``max_tokens_for``)."""
        skip = set(params) | {"max_tokens"}
        if params.get("beam_width") is not None:
            skip.update(NOT_WITH_BEAM_SEARCH)
        return {**{k: v for k, v in self.values.items() if k not in skip}, **params}

    def max_tokens_for(self, params: Mapping[str, Any]) -> Optional[int]:
        """The default ``max_tokens`` of a job that set none (None: no default applies)."""
        default = self.values.get("max_tokens")
        if default is None or "max_tokens" in params:
            return None
        floor = params.get("min_tokens")
        return default if not isinstance(floor, int) or min_tokens_fit(floor, default) else None


def _folder(settings: WorkerSettings) -> Optional[Path]:
    choice = settings.generation_config
    if choice == OFF or (choice == AUTO and (not settings.model
                                             or settings.model.startswith("fake:"))):
        return None
    return Path(settings.model if choice == AUTO else choice)


__all__ = ["SamplingDefaults", "AUTO", "OFF"]
