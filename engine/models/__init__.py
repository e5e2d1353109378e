"""Model implementations. One decoder covers every supported family (see ``decoder.py``); the
layers and ops it is built from are engine/layers/."""

from tokenrelay.engine.models.decoder import DecoderForCausalLM

__all__ = ["DecoderForCausalLM"]
