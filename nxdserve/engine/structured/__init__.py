"""Structured outputs: grammar compilation (llguidance), an LRU cache of compiled grammars, per-request matchers,
and the token bitmask of a step's constrained rows that the sampler applies.

The engine touches this package at four points: ``EngineCore.make_request``/``add_request`` (the request's grammar),
``EngineCore.execute`` (``StructuredOutputManager.fill`` puts the step's ``StepTokenMask`` on the plan), the
sampler (``TokenMask.apply`` in ``sample`` and ``verify``) and ``EngineCore.update`` (``advance`` with the accepted
tokens). A finished grammar allows only the end token, which is how a constrained row stops.
"""

from nxdserve.engine.structured.compiler import GrammarCompiler
from nxdserve.engine.structured.manager import StructuredOutputManager
from nxdserve.engine.structured.mask import StepTokenMask, TokenMask
from nxdserve.engine.structured.spec import StructuredOutputsParams

__all__ = ["GrammarCompiler", "StepTokenMask", "StructuredOutputManager", "StructuredOutputsParams", "TokenMask"]
