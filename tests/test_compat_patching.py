"""megatron_dmoe.compat.patching: a scoped replacement puts back exactly what its owner held."""
import types

import pytest
import torch

from megatron_dmoe.compat.patching import patched, patched_in


def test_an_own_attribute_comes_back_as_it_was_held():
    class Owner:
        @staticmethod
        def f():
            return 1

    with patched(Owner, "f", staticmethod(lambda: 2)):
        assert Owner.f() == Owner().f() == 2
    assert isinstance(vars(Owner)["f"], staticmethod) and Owner().f() == 1


def test_an_inherited_attribute_leaves_no_copy_behind():
    assert "cuda" not in vars(torch.Tensor)  # torch.Tensor inherits it from the C base class
    tensor = torch.ones(1)
    with patched(torch.Tensor, "cuda", lambda self, *args, **kwargs: self):
        assert tensor.cuda() is tensor
    assert "cuda" not in vars(torch.Tensor)


def test_restored_when_the_block_raises_and_in_every_owner():
    first, second = types.SimpleNamespace(x=1), types.SimpleNamespace(x=2)
    with pytest.raises(RuntimeError):
        with patched_in([first, second], "x", 0):
            assert (first.x, second.x) == (0, 0)
            raise RuntimeError
    assert (first.x, second.x) == (1, 2)


def test_a_name_the_owner_lacks_is_refused():
    with pytest.raises(AttributeError):
        with patched(types.SimpleNamespace(), "missing", 0):
            pass
