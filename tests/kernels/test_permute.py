"""The fused permutation kernels and the device-side routing positions against their plain references.

On CPU the kernels run through Triton's interpreter (fp32, fp16); on a GPU the same tests run
compiled. Outputs are poisoned with NaN first, so a row the kernels should have written (a copy or
a padding row) but did not fails the test.
"""
import zlib

import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import reference as R
from dmoe_kernels.permutation import ops as P
from dmoe_kernels.permutation.functional import permute, unpermute

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def _routing(kind, T, E, K, device):
    """[T, K] distinct experts per token: balanced-ish, skewed (one expert takes most) or with empty experts."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((kind, T, E, K)).encode()))
    logits = torch.randn(T, E, generator=g)
    if kind == "skewed":
        logits[:, 1] += 4.0
    elif kind == "empty-experts":
        logits[:, ::2] -= 100.0  # even experts get nothing (needs K <= E // 2)
    return torch.topk(logits, K, dim=1).indices.to(device)


def _layout(indices, E, bs):
    counts = P.expert_counts(indices, E)
    offsets = dk.padded_expert_offsets(counts, bs)
    rows = dk.max_padded_rows(indices.numel(), E, bs)
    return counts, offsets, rows


def _err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values: a row was not written"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


ROUTINGS = [("balanced", 29, 5, 2, 16), ("skewed", 40, 6, 3, 16), ("empty-experts", 23, 8, 4, 32),
            ("skewed", 17, 3, 1, 16), ("balanced", 9, 7, 7, 16),
            ("skewed", 700, 12, 2, 64)]  # 22 blocks of the positions kernels


@pytest.mark.parametrize("kind,T,E,K,bs", ROUTINGS)
def test_positions_match_the_plain_walk(kind, T, E, K, bs, device):
    indices = _routing(kind, T, E, K, device)
    counts, offsets, rows = _layout(indices, E, bs)
    pos = P.padded_positions(indices, counts, offsets)
    expected = R.padded_positions(indices, E, bs)
    assert pos.dtype == torch.int32 and torch.equal(pos.long().cpu(), expected.cpu())
    assert int(pos.max()) < int(offsets[-1]) <= rows
    assert torch.equal(counts.cpu(), torch.bincount(indices.flatten().cpu(), minlength=E))
    # rows already grouped by expert (the expert-parallel path) map onto the same padded rows
    grouped = P.grouped_positions(counts, offsets, T * K)
    assert torch.equal(grouped.flatten().cpu(), pos.flatten()[torch.argsort(indices.flatten(), stable=True)].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("H", [40, 600])  # 600: more than one column chunk per program at K=3
@pytest.mark.parametrize("kind,T,E,K,bs", ROUTINGS[1:3])
@pytest.mark.slow
def test_expand_and_reduce_match_references(kind, T, E, K, bs, H, dtype, device):
    indices = _routing(kind, T, E, K, device)
    counts, offsets, rows = _layout(indices, E, bs)
    pos = P.padded_positions(indices, counts, offsets)
    src = torch.randn(T, H, device=device).to(dtype)
    scale = torch.rand(T, K, device=device)
    other = torch.randn(rows, H, device=device).to(dtype)
    used = int(offsets[-1])

    poisoned = torch.full((rows, H), float("nan"), dtype=dtype, device=device)
    out, dot = P.expand(src, pos, rows, offsets, counts, scale=scale, other=other, out=poisoned)
    ref_out, ref_dot = R.expand(src.double(), pos, rows, scale.double(), other.double())
    assert out is poisoned
    assert _err(out[:used], ref_out[:used]) < TOL[dtype]  # copies and zeroed padding rows
    assert dot.dtype == torch.float32 and _err(dot, ref_dot) < TOL[dtype]

    plain = P.expand(src, pos, rows, offsets, counts)
    assert _err(plain[:used], R.expand(src.double(), pos, rows)[:used]) < TOL[dtype]

    # the row weights, written beside the copies: scale on each copy's row, zero on padding rows
    scale_rows = torch.full((rows,), float("nan"), device=device)
    again = P.expand(src, pos, rows, offsets, counts, scale=scale, scale_rows=scale_rows)
    expected_rows = torch.zeros(rows, dtype=torch.float64)
    expected_rows[pos.reshape(-1).long().cpu()] = scale.double().reshape(-1).cpu()
    assert torch.equal(scale_rows[:used].double().cpu(), expected_rows[:used])
    assert _err(again[:used], ref_out[:used]) < TOL[dtype]

    summed = P.reduce(other, pos, scale)
    assert summed.dtype == dtype and _err(summed, R.reduce(other.double(), pos, scale.double())) < TOL[dtype]
    assert _err(P.reduce(other, pos), R.reduce(other.double(), pos)) < TOL[dtype]

    # each copy's row of partial sums gathered and summed in the same launch
    partials = torch.randn(rows, 7, device=device)
    again, row_sums = P.reduce(other, pos, scale, partials=partials)
    assert torch.equal(again, summed)
    expected = partials.double().cpu().sum(1)[pos.long().cpu()]
    assert row_sums.dtype == torch.float32 and row_sums.shape == pos.shape and _err(row_sums, expected) < 1e-6


@pytest.mark.parametrize("kind,T,E,K,bs", ROUTINGS[:2] + ROUTINGS[3:4])
@pytest.mark.slow
def test_permute_unpermute_gradients(kind, T, E, K, bs, device):
    """Values and gradients of x -> permute -> f -> unpermute(weights) against float64 torch indexing."""
    H = 24
    indices = _routing(kind, T, E, K, device)
    counts, offsets, rows = _layout(indices, E, bs)
    pos = P.padded_positions(indices, counts, offsets)
    x = torch.randn(T, H, device=device, requires_grad=True)
    w = torch.rand(T, K, device=device, requires_grad=True)
    m = torch.randn(rows, H, device=device)  # a per-row factor between the two: the "experts"
    dy = torch.randn(T, H, device=device)

    x_pad = permute(x, pos, rows, offsets, counts)
    y = unpermute(x_pad * m, pos, offsets, counts, w)
    y.backward(dy)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gathered = x64[:, None, :] * m.double()[pos.long()]  # copy (t, j) times its row's factor
    y64 = (w64[..., None] * gathered).sum(1)
    y64.backward(dy.double())
    assert _err(y, y64) < 1e-6
    assert _err(x.grad, x64.grad) < 1e-6
    assert _err(w.grad, w64.grad) < 1e-6
    pad = torch.ones(rows, dtype=torch.bool, device=device)
    pad[pos.flatten().long()] = False
    pad[int(offsets[-1]):] = False  # rows past the used ones are undefined
    assert int(pad.sum()) > 0 and (x_pad[pad] == 0).all()


def test_unpermute_of_a_transient_buffer_keeps_what_the_weight_gradient_needs(device):
    """transient_input=True: the buffer is overwritten after the forward (as the expert-parallel
    exchange reuses its buffers); the router-weight gradient still uses the forward's rows."""
    indices = _routing("skewed", 13, 5, 2, device)
    counts, offsets, rows = _layout(indices, 5, 16)
    pos = P.padded_positions(indices, counts, offsets)
    buffer = torch.randn(rows, 8, device=device)
    y_pad = buffer.clone().requires_grad_()
    w = torch.rand(13, 2, device=device, requires_grad=True)
    dy = torch.randn(13, 8, device=device)
    out = unpermute(y_pad.view_as(y_pad), pos, offsets, counts, w, transient_input=True)
    with torch.no_grad():
        y_pad.fill_(float("nan"))  # the next exchange writes the buffer
    out.backward(dy)
    rows64 = buffer.double()[pos.long()]  # [T, K, H]
    assert _err(out, (w.detach().double()[..., None] * rows64).sum(1)) < 1e-6
    assert _err(w.grad, (dy.double()[:, None, :] * rows64).sum(-1)) < 1e-6


def test_unpermute_without_weights_and_without_weight_gradient(device):
    indices = _routing("balanced", 11, 4, 2, device)
    counts, offsets, rows = _layout(indices, 4, 16)
    pos = P.padded_positions(indices, counts, offsets)
    y_pad = torch.randn(rows, 8, device=device, requires_grad=True)
    w = torch.rand(11, 2, device=device)  # no gradient wanted
    unpermute(y_pad, pos, offsets, counts, w).sum().backward()
    expected = torch.zeros(rows, 8, dtype=torch.float64)
    expected[pos.flatten().long().cpu()] = w.double().flatten().cpu()[:, None].expand(-1, 8)
    used = int(offsets[-1])
    assert _err(y_pad.grad[:used], expected[:used]) < 1e-7
    plain = unpermute(y_pad, pos, offsets, counts)
    assert _err(plain, y_pad.detach().double()[pos.long()].sum(1)) < 1e-6


def test_bad_arguments_raise_clear_errors(device):
    indices = _routing("balanced", 5, 4, 2, device)
    counts, offsets, rows = _layout(indices, 4, 16)
    pos = P.padded_positions(indices, counts, offsets)
    x = torch.randn(5, 8, device=device)
    with pytest.raises(ValueError, match=r"pos must be \[6, top_k\]"):
        P.expand(torch.randn(6, 8, device=device), pos, rows, offsets, counts)
    with pytest.raises(ValueError, match="expert_offsets must be int32"):
        P.expand(x, pos, rows, offsets.long(), counts)
    with pytest.raises(ValueError, match="scale must match pos"):
        P.reduce(torch.randn(rows, 8, device=device), pos, torch.ones(5, 3, device=device))
    with pytest.raises(ValueError, match="out must be a row-major"):
        P.expand(x, pos, rows, offsets, counts, out=torch.empty(rows + 1, 8, device=device))
    with pytest.raises(ValueError, match="scale_rows must be"):  # row weights need the weights
        P.expand(x, pos, rows, offsets, counts, scale_rows=torch.empty(rows, device=device))


@pytest.mark.parametrize("valid", [0, 5, 13])
def test_rows_past_valid_rows_move_nothing(valid, device):
    """valid_rows: the first `valid` of T source rows are real (a bound-sized receive buffer); the
    rest move nothing either way, and the real rows' values and gradients are as without it."""
    T, E, K, H, bs = 13, 4, 1, 24, 16
    indices = _routing("balanced", T, E, K, device)
    counts, offsets, rows = _layout(indices[:valid], E, bs)
    # the dead rows' positions lie past every group, as arrival_positions gives them
    pos = torch.cat([P.padded_positions(indices[:valid], counts, offsets),
                     int(offsets[-1]) + torch.arange(T - valid, device=device, dtype=torch.int32).view(-1, K)])
    rows = rows + T
    x = torch.randn(T, H, device=device, requires_grad=True)
    m = torch.randn(rows, H, device=device)
    dy = torch.randn(T, H, device=device)
    real = torch.tensor([valid], device=device)

    sentinel = torch.full((rows, H), 7.0, device=device)
    out = P.expand(x.detach(), pos, rows, offsets, counts, out=sentinel.clone(), valid_rows=real)
    past = torch.arange(rows, device=device) >= int(offsets[-1])
    assert (out[past] == 7.0).all()  # nothing written past the groups: the dead rows moved nothing
    full = P.expand(x.detach(), pos, rows, offsets, counts)
    assert torch.equal(out[~past], full[~past])

    x_pad = permute(x, pos, rows, offsets, counts, valid_rows=real)
    y = unpermute(x_pad * m, pos, offsets, counts, valid_rows=real)
    y.backward(dy)
    x64 = x.detach().double()[:valid].requires_grad_()
    y64 = (x64[:, None, :] * m.double()[pos[:valid].long()]).sum(1)
    y64.backward(dy.double()[:valid])
    if valid:
        assert _err(y[:valid], y64) < 1e-6
        assert _err(x.grad[:valid], x64.grad) < 1e-6

    summed, row_sums = P.reduce(m, pos, partials=torch.ones(rows, 3, device=device), valid_rows=real)
    assert (row_sums[valid:] == 0).all() and (row_sums[:valid] == 3).all()
    with pytest.raises(ValueError, match="valid_rows must be a one-element integer tensor"):
        P.reduce(m, pos, valid_rows=torch.tensor([1.0, 2.0], device=device))


def test_expand_into_a_window_slot(device):
    """out stacked [W, rows, H] with slot: the slot read on the device gets what a plain expand
    writes (copies and zeroed padding rows), every other slot is left as it was."""
    indices = _routing("random", 40, 4, 2, device)
    counts, offsets, rows = _layout(indices, 4, 16)
    pos = P.padded_positions(indices, counts, offsets)
    src = torch.randn(40, 24, device=device)
    scale = torch.rand(40, 2, device=device)
    used = int(offsets[-1])
    stacked = torch.full((3, rows, 24), float("nan"), device=device)
    slot = torch.tensor([1], dtype=torch.int32, device=device)
    assert P.expand(src, pos, rows, offsets, counts, scale=scale, out=stacked, slot=slot) is None
    plain = P.expand(src, pos, rows, offsets, counts, scale=scale)
    assert torch.equal(stacked[1, :used], plain[:used])
    assert stacked[0].isnan().all() and stacked[2].isnan().all()
    with pytest.raises(ValueError, match="with a slot, out must be a contiguous stacked"):
        P.expand(src, pos, rows, offsets, counts, out=stacked[0], slot=slot)
    with pytest.raises(ValueError, match="slot must be a one-element int32"):
        P.expand(src, pos, rows, offsets, counts, out=stacked, slot=slot.long())
