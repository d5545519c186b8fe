"""The candidate layouts test_layouts trains from: every key of the parallel section has its
values, and a layout that megatron's splits of the world rule out (left out of the candidates) is
refused by validation: every accepted layout at 4 processes with one of its split sizes changed to a
value that breaks its split (up to twice the world size, drawn with a fixed seed)."""
import dataclasses
import random

from layout_checks import CPU, NOT_LAYOUT, WORLD_SPLITS, candidate_overrides, is_layout, layouts, parallel_space
from megatron_dmoe.config import find_problems, load_config, resolve
from megatron_dmoe.config.schema import ParallelConfig


def test_every_parallel_key_has_candidate_values():
    space = parallel_space(4)
    assert sorted(space) == sorted(f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)
                                   if f"parallel.{f.name}" not in NOT_LAYOUT)
    assert all(len(values) > 1 for values in space.values())


def test_a_size_off_the_world_split_is_refused():
    rng, world_size = random.Random(0), 4
    accepted, refused, _ = layouts(world_size, "/nonexistent")
    assert accepted and not set(accepted) & set(refused)
    split_keys = sorted({key for split in WORLD_SPLITS for key in split})
    for name, (kind, values, _) in sorted(accepted.items()):
        for key in split_keys:
            off = [v for v in range(1, 2 * world_size + 1) if not is_layout({**values, key: v}, world_size)]
            changed = {**values, key: rng.choice(off)}
            cfg = resolve(load_config(None, candidate_overrides(kind, changed, world_size, "/nonexistent")))
            assert find_problems(cfg, world_size, env=CPU), (name, key, changed[key])
