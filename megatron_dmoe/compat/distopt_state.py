"""The distributed optimizer's reshardable checkpoint state at the right offsets.

megatron-core (0.16 through 0.19) builds the 'fully_reshardable' optimizer state from one world
tensor per buffer in which the buckets are packed without the padding at each bucket's end, then
slices every parameter out of it at that parameter's offset in the padded buffer. A buffer of more
than one bucket (the tied embedding's own bucket under pipeline parallelism, or a bucket size
smaller than the model) whose earlier buckets end unaligned therefore saves the state of each later
parameter shifted by the padding before it: the checkpoint's main weights and Adam moments are wrong
and a resumed run trains from them. Spreading the packed buckets back to their offsets in the buffer
makes the slices right; loading reads per-parameter tensors and needs nothing else.
"""
from __future__ import annotations

from .patching import wrapped_once


def _spread_over_buckets(optimizer, state: dict) -> dict:
    for gbuf_idx, by_dtype in state.items():
        if not isinstance(gbuf_idx, int):  # 'buckets_coalesced'
            continue
        buffer = optimizer.buffers[gbuf_idx]
        for world in by_dtype.values():
            for key, packed in list(world.items()):
                if key == "numel_unpadded":  # an int beside the tensors
                    continue
                spread = packed.new_zeros(buffer.numel)
                offset = 0
                for bucket, (start, _end) in zip(buffer.buckets, buffer.bucket_indices):
                    n = bucket.numel_unpadded
                    spread[start:start + n] = packed[offset:offset + n]
                    offset += n
                world[key] = spread
    return state


def fix_reshardable_offsets() -> None:
    """Make DistributedOptimizer.sharded_param_state_fully_reshardable slice the buffers at the
    offsets its parameters have (idempotent)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    wrapped_once(DistributedOptimizer, "sharded_param_state_fully_reshardable", _slicing_at_buffer_offsets)


def _slicing_at_buffer_offsets(original):
    def sharded_state(self, *args, **kwargs):
        gather = self.get_parameter_state_dp_zero

        def in_buffer_offsets(*a, **k):
            state = gather(*a, **k)
            return None if state is None else _spread_over_buckets(self, state)

        self.get_parameter_state_dp_zero = in_buffer_offsets
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero

    return sharded_state
