"""SDD, DSD, DDS (all transpose variants, forward and backward) against float64 dense masked matmuls.

On CPU the kernels run through Triton's interpreter (fp32 and fp16: its bf16 dot is broken); on a
GPU the same tests run compiled. Dense widths (K=40, N=37) are deliberately not multiples of the
tile sizes, and several topologies carry padding entries past nnz that the kernels must skip.
"""

import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import reference as ref

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}
K_DENSE, N_DENSE = 40, 37
pytestmark = pytest.mark.usefixtures("seeded_by_name")  # every draw seeded


def _mask(rows, cols, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, cols, generator=g) < density


def _topologies():
    random = _mask(5, 7, 0.45, 1)
    random[2, :] = False  # an empty block row
    random[:, 3] = False  # an empty block column
    single = torch.zeros(3, 4, dtype=torch.bool)
    single[1, 2] = True
    grouped = torch.zeros(5, 6, dtype=torch.bool)
    grouped[0:2, 0:2] = grouped[2:4, 4:6] = True  # the expert structure, built from a mask
    near_miss = torch.zeros(3, 6, dtype=torch.bool)
    near_miss[0, 0:2] = near_miss[1, 2:4] = near_miss[2, 0:2] = True  # group 0 twice: generic path
    return {
        "random-empty-row-col": lambda d: dk.Topology.from_mask(random.to(d), 16, max_blocks=int(random.sum()) + 3),
        "single-block": lambda d: dk.Topology.from_mask(single.to(d), 16),
        "all-blocks": lambda d: dk.Topology.from_mask(torch.ones(3, 2, dtype=torch.bool, device=d), 16),
        "tall-bs32": lambda d: dk.Topology.from_mask(_mask(5, 2, 0.6, 2).to(d), 32),
        "experts-empty": lambda d: dk.Topology.for_experts(torch.tensor([5, 0, 40, 17], device=d), 62, 64, 16),
        "experts-skewed-odd": lambda d: dk.Topology.for_experts(torch.tensor([0, 0, 70, 1, 0], device=d), 71, 48, 16),
        "mask-expert-structure": lambda d: dk.Topology.from_mask(grouped.to(d), 16, max_blocks=12),
        "mask-near-miss": lambda d: dk.Topology.from_mask(near_miss.to(d), 16),
        "nothing": lambda d: dk.Topology.from_mask(torch.zeros(2, 3, dtype=torch.bool, device=d), 16, max_blocks=2),
    }


TOPOLOGIES = _topologies()
DTYPES = [torch.float32, torch.float16]


def _rel_err(out, expected):
    assert torch.isfinite(out).all(), "non-finite values: an output was not written"
    num = (out.detach().double() - expected.detach().double()).norm()
    den = expected.detach().double().norm()
    return float(num / den) if den > 0 else float(num)


def _nnz(t):
    return int(t.nnz)


def _sparse_err(out, expected, topology):
    n = _nnz(topology)
    return _rel_err(out[:n], expected[:n])


def _randn(shape, dtype, device):
    return torch.randn(shape, device=device).to(dtype)


@pytest.fixture(params=list(TOPOLOGIES), ids=list(TOPOLOGIES))
def topology(request, device):
    return TOPOLOGIES[request.param](device)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.slow
def test_sdd(topology, dtype, device):
    rows, cols = topology.shape
    a = _randn((rows, K_DENSE), dtype, device).requires_grad_()
    # b is a transposed weight, as in the expert MLP: exercises strided operands.
    w = _randn((cols, K_DENSE), dtype, device).requires_grad_()
    out = dk.sdd(a, w.t(), topology)
    a64, w64 = a.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    expected = ref.sdd(a64, w64.t(), topology)
    assert _sparse_err(out, expected, topology) < TOLERANCE[dtype]

    grad = _randn(out.shape, dtype, device)
    out.backward(grad)
    expected.backward(grad.double())
    assert _rel_err(a.grad, a64.grad) < TOLERANCE[dtype]
    assert _rel_err(w.grad, w64.grad) < TOLERANCE[dtype]


@pytest.mark.parametrize("transpose", [False, True], ids=["S@B", "St@B"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.slow
def test_dsd(topology, dtype, transpose, device):
    rows, cols = topology.shape
    data = _randn(topology.data_shape(), dtype, device).requires_grad_()
    b = _randn((rows if transpose else cols, N_DENSE), dtype, device).requires_grad_()
    out = dk.dsd(data, topology, b, transpose=transpose)
    d64, b64 = data.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    expected = ref.dsd(d64, topology, b64, transpose=transpose)
    assert out.shape == expected.shape
    assert _rel_err(out, expected) < TOLERANCE[dtype]

    grad = _randn(out.shape, dtype, device)
    out.backward(grad)
    expected.backward(grad.double())
    assert _sparse_err(data.grad, d64.grad, topology) < TOLERANCE[dtype]
    assert _rel_err(b.grad, b64.grad) < TOLERANCE[dtype]


@pytest.mark.parametrize("transpose", [False, True], ids=["A@S", "A@St"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.slow
def test_dds(topology, dtype, transpose, device):
    rows, cols = topology.shape
    data = _randn(topology.data_shape(), dtype, device).requires_grad_()
    a = _randn((N_DENSE, cols if transpose else rows), dtype, device).requires_grad_()
    out = dk.dds(a, data, topology, transpose=transpose)
    a64, d64 = a.detach().double().requires_grad_(), data.detach().double().requires_grad_()
    expected = ref.dds(a64, d64, topology, transpose=transpose)
    assert out.shape == expected.shape
    assert _rel_err(out, expected) < TOLERANCE[dtype]

    grad = _randn(out.shape, dtype, device)
    out.backward(grad)
    expected.backward(grad.double())
    assert _rel_err(a.grad, a64.grad) < TOLERANCE[dtype]
    assert _sparse_err(data.grad, d64.grad, topology) < TOLERANCE[dtype]


@pytest.mark.slow
def test_raw_ops_write_every_output(topology, device):
    """Outputs poisoned with NaN: every existing block and every dense element must be overwritten."""
    dtype = torch.float32
    rows, cols = topology.shape
    a = _randn((rows, K_DENSE), dtype, device)
    b = _randn((K_DENSE, cols), dtype, device)
    out = torch.full(topology.data_shape(), float("nan"), device=device)
    dk.ops.sdd(a, b, topology, out=out)
    assert _sparse_err(out, ref.sdd(a.double(), b.double(), topology), topology) < 1e-5

    data = _randn(topology.data_shape(), dtype, device)
    for transpose in (False, True):
        s_rows, s_cols = (cols, rows) if transpose else (rows, cols)
        dense = _randn((s_cols, N_DENSE), dtype, device)
        out = torch.full((s_rows, N_DENSE), float("nan"), device=device)
        dk.ops.dsd(data, topology, dense, transpose=transpose, out=out)
        assert _rel_err(out, ref.dsd(data.double(), topology, dense.double(), transpose)) < 1e-5
        dense = _randn((N_DENSE, s_rows), dtype, device)
        out = torch.full((N_DENSE, s_cols), float("nan"), device=device)
        dk.ops.dds(dense, data, topology, transpose=transpose, out=out)
        assert _rel_err(out, ref.dds(dense.double(), data.double(), topology, transpose)) < 1e-5


def test_reference_round_trip(topology, device):
    data = _randn(topology.data_shape(), torch.float64, device)
    back = ref.from_dense(ref.to_dense(data, topology), topology)
    n = _nnz(topology)
    assert torch.equal(back[:n], data[:n])
    assert int(ref.block_mask_dense(topology).sum()) == n * topology.block_size ** 2


def test_expert_mlp_chain(device):
    """The six products of one expert MLP, as the dMoE layer will chain them, against dense math."""
    bs, ffn, d, E = 16, 32, 24, 3
    counts = torch.tensor([9, 0, 20], device=device)
    topo = dk.Topology.for_experts(counts, 29, ffn, bs)
    rows = topo.shape[0]
    x = torch.randn(rows, d, device=device, requires_grad=True)
    w1 = torch.randn(E * ffn, d, device=device, requires_grad=True)
    w2 = torch.randn(E * ffn, d, device=device, requires_grad=True)
    h = dk.sdd(x, w1.t(), topo)
    y = dk.dsd(torch.nn.functional.gelu(h), topo, w2)
    grad = torch.randn_like(y)
    y.backward(grad)

    # Dense float64 version: each row of the padded buffer meets only its own expert's weights.
    x64, w164, w264 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    mask = ref.block_mask_dense(topo, torch.float64)
    y64 = (torch.nn.functional.gelu(x64 @ w164.t()) * mask) @ w264
    y64.backward(grad.double())
    assert _rel_err(y, y64) < 1e-5
    for got, want in ((x.grad, x64.grad), (w1.grad, w164.grad), (w2.grad, w264.grad)):
        assert _rel_err(got, want) < 1e-5
    # Rows past the used ones, and the empty expert's weights, get exactly zero.
    used = int(topo.expert_offsets[-1])
    assert torch.count_nonzero(y[used:]) == 0
    assert torch.count_nonzero(w1.grad[ffn:2 * ffn]) == 0


def test_backward_with_broadcast_gradients(device):
    """y.sum().backward() hands the kernels an expanded gradient (all strides 0)."""
    counts = torch.tensor([7, 0, 30], device=device)
    topo = dk.Topology.for_experts(counts, 37, 32, 16)
    rows = topo.shape[0]
    x = torch.randn(rows, K_DENSE, device=device, requires_grad=True)
    w1 = torch.randn(3 * 32, K_DENSE, device=device, requires_grad=True)
    w2 = torch.randn(3 * 32, K_DENSE, device=device, requires_grad=True)
    dk.dsd(dk.sdd(x, w1.t(), topo), topo, w2).sum().backward()
    x64, w164, w264 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    ref.dsd(ref.sdd(x64, w164.t(), topo), topo, w264).sum().backward()
    for got, want in ((x.grad, x64.grad), (w1.grad, w164.grad), (w2.grad, w264.grad)):
        assert _rel_err(got, want) < 1e-5


def test_shape_and_dtype_errors(device):
    topo = dk.Topology.from_mask(torch.ones(2, 3, dtype=torch.bool, device=device), 16)
    a = torch.randn(32, 8, device=device)
    with pytest.raises(ValueError, match=r"a has 31 rows but the sparse output has 32 \(topology.shape\[0\]\)"):
        dk.ops.sdd(a[:31], torch.randn(8, 48, device=device), topo)
    with pytest.raises(ValueError, match=r"b has 40 columns but the sparse output has 48"):
        dk.ops.sdd(a, torch.randn(8, 40, device=device), topo)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        dk.ops.sdd(a, torch.randn(9, 48, device=device), topo)
    with pytest.raises(TypeError, match="all operands must share one dtype"):
        dk.ops.sdd(a, torch.randn(8, 48, device=device, dtype=torch.float16), topo)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        dk.ops.sdd(a.double(), torch.randn(8, 48, device=device, dtype=torch.float64), topo)
    data = torch.randn(topo.data_shape(), device=device)
    with pytest.raises(ValueError, match=r"b has 32 rows but S has 48 columns"):
        dk.ops.dsd(data, topo, torch.randn(32, 5, device=device))
    with pytest.raises(ValueError, match="data has shape"):
        dk.ops.dsd(data[:1], topo, torch.randn(48, 5, device=device))
    with pytest.raises(ValueError, match=r"a has 40 columns but S has 32 rows"):
        dk.ops.dds(torch.randn(5, 40, device=device), data, topo)


def _config_cases():
    sdd = [dk.SddConfig(blocks_per_program=nb, block_k=16, group_m=g, persistent=p, flatten=fl)
           for nb in (1, 2) for g in (2, 3) for p, fl in ((False, True), (True, True), (True, False))]
    dsd = [dk.DsdConfig(block_n=32, block_k=16, group_m=g, persistent=p, flatten=fl)
           for g in (2, 3) for p, fl in ((False, True), (True, True), (True, False))]
    return sdd, dsd


SDD_CONFIGS, DSD_CONFIGS = _config_cases()


@pytest.mark.parametrize("counts, ffn", [([5, 0, 40, 17, 33], 64), ([0, 0, 70, 1, 0], 48)],
                         ids=["F4-9rows", "F3-skewed"])
@pytest.mark.slow
def test_every_config_on_expert_topologies(counts, ffn, device):
    """Program orders (GROUP_M not dividing the rows), multi-block tiles and persistent kernels."""
    counts = torch.tensor(counts, device=device)
    topo = dk.Topology.for_experts(counts, int(counts.sum()), ffn, 16)
    rows, cols = topo.shape
    n = _nnz(topo)
    x, w = _randn((rows, K_DENSE), torch.float32, device), _randn((cols, K_DENSE), torch.float32, device)
    expected = ref.sdd(x.double(), w.double().t(), topo)
    for cfg in SDD_CONFIGS:
        if topo.blocks_per_row % cfg.blocks_per_program:
            continue
        out = torch.full(topo.data_shape(), float("nan"), device=device)
        dk.ops.sdd(x, w.t(), topo, out=out, config=cfg)
        assert _rel_err(out[:n], expected[:n]) < 1e-5, cfg
    data = _randn(topo.data_shape(), torch.float32, device)
    for transpose in (False, True):
        b = x if transpose else w
        expected = ref.dsd(data.double(), topo, b.double(), transpose)
        for cfg in DSD_CONFIGS:
            out = torch.full(expected.shape, float("nan"), device=device)
            dk.ops.dsd(data, topo, b, transpose=transpose, out=out, config=cfg)
            assert _rel_err(out, expected) < 1e-5, (transpose, cfg)


def test_sdd_programs_past_the_last_group_exit(device):
    """7 block rows in groups of 4 on the generic kernel: the last group's 3 rows leave some of its
    programs idle, and the grid (max_blocks) has programs past it. They must exit: otherwise they
    overwrite a block of a later row with another row's product, or write blocks past nnz."""
    counts = torch.tensor([40, 30, 20], device=device)
    topo = dk.Topology.for_experts(counts, int(counts.sum()), 32, 16)
    n = _nnz(topo)
    assert (n // topo.blocks_per_row, topo.max_blocks) == (7, 18)
    rows, cols = topo.shape
    x, w = _randn((rows, K_DENSE), torch.float32, device), _randn((cols, K_DENSE), torch.float32, device)
    expected = ref.sdd(x.double(), w.double().t(), topo)
    for nb in (1, 2):
        out = torch.full(topo.data_shape(), float("nan"), device=device)
        dk.ops.sdd(x, w.t(), topo, out=out, config=dk.SddConfig(blocks_per_program=nb, block_k=16, group_m=4))
        assert _rel_err(out[:n], expected[:n]) < 1e-5, nb
        assert torch.isnan(out[n:]).all(), nb
