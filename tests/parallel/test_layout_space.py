"""The candidate layouts test_layouts trains from: every key of the parallel section has its
values, and what they leave out as no layout (megatron's splits of the world do not hold) is
refused by validation (a seeded sample of it, sizes up to twice the world size)."""
import dataclasses
import random

from layout_checks import CPU, candidate_overrides, is_layout, layouts, parallel_space
from megatron_dmoe.config import find_problems, load_config, resolve
from megatron_dmoe.config.schema import ParallelConfig


def test_every_parallel_key_has_candidate_values():
    space = parallel_space(4)
    assert sorted(space) == sorted(f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig))
    assert all(len(values) > 1 for values in space.values())


def test_what_is_left_out_as_no_layout_is_refused():
    rng = random.Random(0)
    for world_size in (2, 4, 8):
        wider = {key: values if False in values else values + tuple(range(world_size + 1, 2 * world_size + 1))
                 for key, values in parallel_space(world_size).items()}  # sizes only, not the booleans
        left_out = 0
        while left_out < 20:
            values = {key: rng.choice(choices) for key, choices in wider.items()}
            if is_layout(values, world_size) and all((v or 0) <= world_size for v in values.values()):
                continue
            left_out += 1
            for kind in ("dense", "moe"):
                cfg = resolve(load_config(None, candidate_overrides(kind, values, world_size, "/nonexistent")))
                assert find_problems(cfg, world_size, env=CPU), (world_size, kind, values)


def test_candidates_at_two_processes():
    accepted, refused, _ = layouts(2, "/nonexistent")
    assert not set(accepted) & set(refused)
    assert "moe-tp2-pp1-ep1-etp2-sp1-cp1" in accepted and "moe-tp1-pp1-ep1-etp1-sp0-cp2" in refused
