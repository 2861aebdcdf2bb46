"""Defaults of the evaluations, apart from the evaluation modules (which import torch and re-export them): a
signature that takes them as its defaults loads no torch."""

from __future__ import annotations

#: how far (accuracy, either way) a neighbour may move from base in any state before the report names it
NEIGHBOUR_TOLERANCE = 0.03
#: the learning rates an attacker tries by default, an order of magnitude apart (LoRA's are higher, as usual)
DEFAULT_LRS = {"full": (1e-5, 1e-4, 1e-3), "lora": (1e-4, 1e-3, 1e-2)}
#: the attacks ``modular attack`` runs by default, by short name (:data:`modular.evaluation.attacks.BUILTIN_ATTACKS`);
#: a list, not a tuple, so that ``--attacks+=X`` adds X to them (jsonargparse replaces a tuple default); never mutated
DEFAULT_ATTACKS = ["weights", "steering", "relearning", "neutral", "prefill", "quantized", "unrelated"]
#: the quantisations attack (f) applies to the published model and the base alike: the releases people make (int8,
#: int4 and llama.cpp's 8- and 4-bit block formats)
DEFAULT_QUANTIZED = ("int8", "int4", "q8_0", "q4_0", "q4_1")
