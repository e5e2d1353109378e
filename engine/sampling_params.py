"""Sampling parameters for the engine: the wire schema, re-exported.

The schema is part of the job protocol, so it lives in ``protocol/sampling_params.py`` (the
SDK validates with it without importing the engine); ``engine.SamplingParams`` and this module
keep the engine's public name working unchanged.
"""

from tokenrelay.protocol.sampling_params import SamplingParams
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
