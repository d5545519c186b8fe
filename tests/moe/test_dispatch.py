"""Permutation into expert-grouped rows and back, dropless and with a capacity."""
import pytest
import torch

from megatron_dmoe.moe import CapacityDispatcher, DroplessDispatcher, expert_capacity


def tokens(T, h=3):
    # row t is filled with the value t + 1, so every buffer row names its token
    return (torch.arange(T, dtype=torch.float64)[:, None] + 1).expand(T, h).clone()


def test_dropless_groups_rows_by_expert_in_token_order():
    x = tokens(4)
    indices = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    d = DroplessDispatcher(4)
    x_perm, counts, state = d.dispatch(x, indices, weights)
    # expert 0: tokens 0, 1, 3; expert 1: tokens 1, 2; expert 2: tokens 0, 2, 3; expert 3: none
    assert x_perm[:, 0].tolist() == [1, 2, 4, 2, 3, 1, 3, 4]
    assert counts.tolist() == [3, 2, 3, 0]
    # each expert doubles its rows plus its id: y(t, e) = 2 * (t + 1) + e
    expert_of_row = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2], dtype=torch.float64)[:, None]
    y = d.combine(2 * x_perm + expert_of_row, state)
    expected = [
        0.5 * (2 + 2) + 0.25 * (2 + 0),
        1.0 * (4 + 0) + 2.0 * (4 + 1),
        3.0 * (6 + 2) + 4.0 * (6 + 1),
        5.0 * (8 + 0) + 6.0 * (8 + 2),
    ]
    assert y[:, 0].tolist() == expected and y.shape == (4, 3)


def test_dropless_weight_and_input_gradients():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([[1, 0], [0, 2], [2, 1], [1, 0], [0, 2]])
    d = DroplessDispatcher(3)
    x_perm, _, state = d.dispatch(x, indices, weights)
    y = d.combine(x_perm * 3.0, state)  # "experts" that triple their input
    g = torch.randn(5, 3, dtype=torch.float64)
    y.backward(g)
    # y_t = 3 x_t * sum_j w_tj: dy/dx = 3 sum_j w_tj, dy/dw_tj = 3 x_t . g_t
    assert torch.allclose(x.grad, 3 * weights.detach().sum(1, keepdim=True) * g)
    assert torch.allclose(weights.grad, (3 * (x.detach() * g).sum(1, keepdim=True)).expand(5, 2))


def test_capacity_formula():
    assert expert_capacity(4, 1, 2, 1.0) == 2
    assert expert_capacity(37, 2, 8, 1.0) == 10  # ceil(9.25)
    assert expert_capacity(10, 2, 4, 1.5) == 8  # ceil(7.5)


@pytest.mark.parametrize("policy,dropped", [("position", 2), ("probs", 0)])
def test_capacity_top1_drops_the_overflowing_token(policy, dropped):
    x = tokens(4)
    indices = torch.tensor([[0], [0], [0], [1]])
    weights = torch.tensor([[0.6], [0.9], [0.7], [0.8]], dtype=torch.float64)
    d = CapacityDispatcher(2, 1.0, policy)  # capacity ceil(1.0 * 4 * 1 / 2) = 2
    buf, kept, state = d.dispatch(x, indices, weights)
    assert buf.shape == (2, 2, 3) and kept.tolist() == [2, 1]
    expert0 = sorted(int(v) - 1 for v in buf[0, :, 0])
    assert expert0 == sorted({0, 1, 2} - {dropped})
    assert buf[1, :, 0].tolist() == [4, 0]  # token 3, then an unused zero row
    y = d.combine(buf + 10.0, state)  # "experts" add 10
    for t in range(4):
        expected = 0.0 if t == dropped else weights[t, 0].item() * (t + 1 + 10)
        assert y[t, 0].item() == pytest.approx(expected)


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_capacity_top2_keeps_priority_order_per_expert(policy):
    x = tokens(3)
    indices = torch.tensor([[0, 1], [0, 2], [0, 1]])
    weights = torch.tensor([[0.3, 0.1], [0.2, 0.5], [0.6, 0.4]], dtype=torch.float64)
    d = CapacityDispatcher(3, 1.0, policy)  # capacity ceil(3 * 2 / 3) = 2; expert 0 has 3 assignments
    buf, kept, state = d.dispatch(x, indices, weights)
    assert kept.tolist() == [2, 2, 1]
    # position keeps tokens 0 and 1 at expert 0; probs keeps the weights 0.6 (token 2) and 0.3 (token 0)
    expected0 = [1, 2] if policy == "position" else [3, 1]
    assert buf[0, :, 0].tolist() == expected0
    # rows inside an expert follow the same priority: token order, or highest weight first
    assert buf[1, :, 0].tolist() == ([1, 3] if policy == "position" else [3, 1])
    assert buf[2, :, 0].tolist() == [2, 0]
    dropped_token = 2 if policy == "position" else 1
    y = d.combine(buf, state)  # identity experts
    for t in range(3):
        keep = [j for j in range(2) if not (t == dropped_token and j == 0)]
        assert y[t, 0].item() == pytest.approx(sum(weights[t, j].item() for j in keep) * (t + 1))
