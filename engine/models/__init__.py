"""Model implementations. One decoder covers every supported family (see ``decoder.py``)."""

from tokenrelay.engine.models.decoder import DecoderForCausalLM
from tokenrelay.engine.models.ops import Ops, get_ops

__all__ = ["DecoderForCausalLM", "Ops", "get_ops"]
