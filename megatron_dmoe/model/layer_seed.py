"""Layer initialisation that does not depend on the pipeline layout.

Megatron seeds each pipeline stage differently, so a layer's initial weights depend on which stage
builds it; a run split over pipeline stages would then not train as the same run in one process.
Here every transformer layer is built right after the default generators are seeded from the
run's seed and the layer's global number: its weights (and everything the last layer's stage
initialises after it) are the same at any pipeline size and number of virtual stages.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

_run_seed: Optional[int] = None


def set_layer_init_seed(seed: Optional[int]) -> None:
    """The run's seed (training sets it before building the model); None: no per-layer seeding."""
    global _run_seed
    _run_seed = seed


def _layer_seed(global_layer_number: int) -> int:
    return (_run_seed * 1_000_003 + 7919 * global_layer_number) % (2**63 - 1)


@functools.lru_cache(maxsize=None)
def seeded_layer_class(layer_class: type) -> type:
    """`layer_class` (megatron's TransformerLayer or a subclass) seeding the default generators
    before it builds, when a run seed is set."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    class SeededLayer(layer_class):
        def __init__(self, config, *args, layer_number: int = 1, vp_stage: Optional[int] = None, **kwargs):
            if _run_seed is not None:
                torch.manual_seed(_layer_seed(layer_number + get_transformer_layer_offset(config, vp_stage)))
            super().__init__(config, *args, layer_number=layer_number, vp_stage=vp_stage, **kwargs)

    SeededLayer.__name__ = SeededLayer.__qualname__ = layer_class.__name__
    return SeededLayer
