"""ops.dsd(..., out=out, accumulate=True): out += S @ b (or S^T @ b) in the kernels' epilogue; and
without accumulate into an fp32 out under 16-bit operands: out = the product, out never read.

Every kernel path that can accumulate is forced by its config and checked to have been the one
that ran: the generic kernel (irregular topologies, or a non-persistent config), dsd_tma_kernel
(persistent; S @ b, and S^T @ b without flattening) and dsdt_tma_kernel (persistent, S^T @ b,
flattened). The reference is float64: out's old values plus the dense masked product.
On CPU the kernels run through Triton's interpreter (fp32 and fp16 operands; its bf16 dot is broken).
"""
import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import reference as ref
from dmoe_kernels.products.kernels import dsd_tma as dsd_tma_module, dsdt_tma as dsdt_tma_module

N_DENSE = 40  # TMA-ready rows for fp32 and fp16, and not a multiple of block_n=32: the N edge is masked
# By out's dtype: the reference takes the rounded operands, so an fp32 out differs only by fp32
# accumulation; a 16-bit out adds one rounding of the sum.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3}


def _config(persistent, flatten):
    return dk.DsdConfig(block_n=32, block_k=16, group_m=2, persistent=persistent, flatten=flatten)


# name: (transpose, config, the TMA kernel expected to run or None for the generic one)
PATHS = {
    "generic-S@B": (False, _config(False, True), None),
    "generic-St@B": (True, _config(False, True), None),
    "tma-S@B": (False, _config(True, True), "dsd_tma_kernel"),
    "tma-St@B": (True, _config(True, False), "dsd_tma_kernel"),
    "dsdt-tma-St@B": (True, _config(True, True), "dsdt_tma_kernel"),
}


def _irregular(device):
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(5, 6, generator=g) < 0.5
    mask[3, :] = False  # an empty block row
    mask[:, 1] = False  # an empty block column
    return dk.Topology.from_mask(mask.to(device), 16, max_blocks=int(mask.sum()) + 2)


REGULAR = {
    # experts without tokens, a partial last block, rows past the used ones
    "experts-bs16": lambda d: dk.Topology.for_experts(torch.tensor([5, 0, 40, 17], device=d), 62, 64, 16),
    "experts-bs32-skewed": lambda d: dk.Topology.for_experts(torch.tensor([0, 70, 1], device=d), 71, 64, 32),
    "no-tokens": lambda d: dk.Topology.for_experts(torch.zeros(3, dtype=torch.long, device=d), 0, 32, 16),
}

# (operand dtype, out dtype): fp32 main_grad under 16-bit operands, and out in the operands' dtype
DTYPE_PAIRS = {
    "fp32-out-fp32": (torch.float32, torch.float32),
    "fp16-out-fp32": (torch.float16, torch.float32),
    "fp16-out-fp16": (torch.float16, torch.float16),
}


class _LaunchLog:
    """Wraps a kernel so that launches are recorded with their epilogue: (name, how, where), how
    "add" or "store" (OVERWRITE, or the TMA strips, which only store), where "pointers" (ACCUMULATE),
    "strips" (STRIPS) or "tma" (the plain TMA store)."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            where = "strips" if kwargs.get("STRIPS") else "pointers" if kwargs.get("ACCUMULATE") else "tma"
            self.log.append((self.name, "store" if kwargs.get("OVERWRITE") or kwargs.get("STRIPS") else "add", where))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def tma_launches(monkeypatch):
    log = []
    for module, name in ((dsd_tma_module, "dsd_tma_kernel"), (dsdt_tma_module, "dsdt_tma_kernel")):
        monkeypatch.setattr(module, name, _LaunchLog(getattr(module, name), name, log))
    return log


def _inputs(topology, transpose, dtype, out_dtype, device, out_row_stride=None):
    rows, cols = topology.shape
    s_rows, s_cols = (cols, rows) if transpose else (rows, cols)
    data = torch.randn(topology.data_shape(), device=device).to(dtype)
    b = torch.randn(s_cols, N_DENSE, device=device).to(dtype)
    # out may be a row-major view with a wider row stride (a column slice of a larger buffer)
    width = out_row_stride or N_DENSE
    out = torch.randn(s_rows, width, device=device).to(out_dtype)[:, :N_DENSE]
    return data, b, out


def _check_accumulates(topology, transpose, cfg, dtype, out_dtype, device, out_row_stride=None):
    data, b, out = _inputs(topology, transpose, dtype, out_dtype, device, out_row_stride)
    expected = out.double() + ref.dsd(data.double(), topology, b.double(), transpose)
    before = out.data_ptr()
    result = dk.ops.dsd(data, topology, b, transpose=transpose, out=out, config=cfg, accumulate=True)
    assert result is out and out.data_ptr() == before and out.dtype == out_dtype
    err = float((out.double() - expected).norm() / expected.norm())
    assert err < TOLERANCE[out_dtype], err


@pytest.mark.parametrize("pair", list(DTYPE_PAIRS))
@pytest.mark.parametrize("topology_name", list(REGULAR))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.slow
def test_accumulate_on_regular_topologies(path, topology_name, pair, device, tma_launches):
    transpose, cfg, expected_kernel = PATHS[path]
    topology = REGULAR[topology_name](device)
    dtype, out_dtype = DTYPE_PAIRS[pair]
    _check_accumulates(topology, transpose, cfg, dtype, out_dtype, device)
    if expected_kernel is None or topology.max_blocks == 0:  # nothing stored: the generic kernel adds zeros
        assert tma_launches == []
    else:
        assert tma_launches == [(expected_kernel, "add", "pointers")]


@pytest.mark.parametrize("pair", list(DTYPE_PAIRS))
@pytest.mark.parametrize("transpose", [False, True], ids=["S@B", "St@B"])
@pytest.mark.slow
def test_accumulate_on_irregular_topology(transpose, pair, device, tma_launches):
    """Irregular topologies always take the generic kernel, whatever the config asks."""
    dtype, out_dtype = DTYPE_PAIRS[pair]
    for cfg in (None, _config(True, True)):
        _check_accumulates(_irregular(device), transpose, cfg, dtype, out_dtype, device)
    assert tma_launches == []


@pytest.mark.parametrize("path", [p for p, (_, _, kernel) in PATHS.items() if kernel])
def test_tma_paths_accumulate_into_rows_that_tma_could_not_store(path, device, tma_launches):
    """A row stride of 43 fp32 elements (172 bytes) is no TMA layout: the accumulating epilogue
    stores through pointers, so the persistent kernels still run and must honour the stride."""
    transpose, cfg, expected_kernel = PATHS[path]
    topology = REGULAR["experts-bs16"](device)
    _check_accumulates(topology, transpose, cfg, torch.float16, torch.float32, device, out_row_stride=43)
    assert tma_launches == [(expected_kernel, "add", "pointers")]


def test_accumulating_twice_adds_both_products(device):
    """Two micro-batches into one fp32 buffer, as gradient accumulation does."""
    topology = REGULAR["experts-bs16"](device)
    rows, cols = topology.shape
    out = torch.zeros(cols, N_DENSE, device=device)
    expected = torch.zeros(cols, N_DENSE, dtype=torch.float64, device=device)
    for _ in range(2):
        data = torch.randn(topology.data_shape(), device=device).half()
        b = torch.randn(rows, N_DENSE, device=device).half()
        dk.ops.dsd(data, topology, b, transpose=True, out=out, accumulate=True)
        expected += ref.dsd(data.double(), topology, b.double(), True)
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-5


def test_accumulate_argument_errors(device):
    topology = REGULAR["experts-bs16"](device)
    rows, cols = topology.shape
    data = torch.randn(topology.data_shape(), device=device).half()
    b = torch.randn(rows, N_DENSE, device=device).half()

    def dsd_t(out):
        return dk.ops.dsd(data, topology, b, transpose=True, out=out, accumulate=True)

    with pytest.raises(ValueError, match="accumulate=True adds into out; pass the tensor"):
        dsd_t(None)
    with pytest.raises(ValueError, match=rf"out must have shape \({cols}, {N_DENSE}\) to accumulate into"):
        dsd_t(torch.zeros(cols, N_DENSE + 1, device=device))
    with pytest.raises(TypeError, match="out has dtype torch.float64; accumulation takes float32 or"):
        dsd_t(torch.zeros(cols, N_DENSE, dtype=torch.float64, device=device))
    with pytest.raises(TypeError, match="out has dtype torch.bfloat16"):
        dsd_t(torch.zeros(cols, N_DENSE, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="row-major with unit inner stride"):
        dsd_t(torch.zeros(N_DENSE, cols, device=device).t())
    with pytest.raises(ValueError, match="row-major with unit inner stride"):
        dsd_t(torch.zeros(1, N_DENSE, device=device).expand(cols, N_DENSE))  # rows alias each other
    # Without accumulate, out takes the operands' dtype or float32.
    with pytest.raises(ValueError, match=r"out must have shape .* and dtype torch.float16 \(or float32\)"):
        dk.ops.dsd(data, topology, b, transpose=True, out=torch.zeros(cols, N_DENSE, dtype=torch.float64,
                                                                      device=device))
    with pytest.raises(ValueError, match="row-major with unit inner stride"):
        dk.ops.dsd(data, topology, b, transpose=True, out=torch.zeros(N_DENSE, cols, device=device).t())


@pytest.mark.gpu
@pytest.mark.parametrize("path", [p for p, (_, _, kernel) in PATHS.items() if kernel])
def test_bf16_operands_accumulate_into_fp32_on_tma_paths(path, tma_launches):
    """bf16 operands (the training dtype) into an fp32 main_grad, compiled on a GPU."""
    transpose, cfg, expected_kernel = PATHS[path]
    device = torch.device("cuda")
    topology = REGULAR["experts-bs16"](device)
    _check_accumulates(topology, transpose, cfg, torch.bfloat16, torch.float32, device)
    # and with the tuned configs of the device (128-wide blocks, Hopper pipelines)
    counts = torch.tensor([300, 0, 517, 64], device=device)
    topology = dk.Topology.for_experts(counts, int(counts.sum()), 256, 128)
    _check_accumulates(topology, transpose, None, torch.bfloat16, torch.float32, device)
    assert tma_launches[0] == (expected_kernel, "add", "pointers")


@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("flatten", [False, True], ids=["dsd-tma", "dsdt-tma"])
@pytest.mark.slow
def test_wide_tiles_add_in_column_strips(block_n, flatten, device):
    """Tiles wider than 64 columns are added in strips of 64 (halved once or twice); the last strip
    runs past N = 200 and is masked."""
    topology = REGULAR["experts-bs16"](device)
    cfg = dk.DsdConfig(block_n=block_n, block_k=16, group_m=2, persistent=True, flatten=flatten)
    g = torch.Generator().manual_seed(block_n)
    data = torch.randn(topology.data_shape(), generator=g).to(device)
    b = torch.randn(topology.shape[0], 200, generator=g).to(device)
    out = torch.randn(topology.shape[1], 200, generator=g).to(device)
    expected = out.double() + ref.dsd(data.double(), topology, b.double(), True)
    dk.ops.dsd(data, topology, b, transpose=True, out=out, config=cfg, accumulate=True)
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-5


def _check_overwrites(topology, transpose, cfg, device, out_row_stride=None):
    """fp16 operands into an fp32 out full of NaN: every element must be the float64 product (rows of
    S @ b past the used ones zero), so no old value was read or left."""
    data, b, out = _inputs(topology, transpose, torch.float16, torch.float32, device, out_row_stride)
    out.fill_(float("nan"))
    expected = ref.dsd(data.double(), topology, b.double(), transpose)
    result = dk.ops.dsd(data, topology, b, transpose=transpose, out=out, config=cfg)
    assert result is out and not out.isnan().any()
    assert float((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)) < 1e-5 or expected.norm() == 0
    assert out.double().abs().max() <= expected.abs().max() * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("topology_name", list(REGULAR))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.slow
def test_wide_out_is_overwritten_on_regular_topologies(path, topology_name, device, tma_launches):
    transpose, cfg, expected_kernel = PATHS[path]
    topology = REGULAR[topology_name](device)
    _check_overwrites(topology, transpose, cfg, device)
    if expected_kernel is None or topology.max_blocks == 0:
        assert tma_launches == []
    else:
        # the weight-gradient kernel stores a TMA-ready fp32 out through TMA strips
        assert tma_launches == [(expected_kernel, "store", "strips" if expected_kernel == "dsdt_tma_kernel"
                                 else "pointers")]


@pytest.mark.parametrize("transpose", [False, True], ids=["S@B", "St@B"])
def test_wide_out_is_overwritten_on_irregular_topology_and_strided_rows(transpose, device):
    _check_overwrites(_irregular(device), transpose, None, device)
    _check_overwrites(REGULAR["experts-bs16"](device), transpose, _config(True, True), device, out_row_stride=43)


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [False, True], ids=["S@B", "St@B"])
def test_bf16_operands_overwrite_fp32_with_tuned_configs(transpose, tma_launches):
    """bf16 operands into a NaN-filled fp32 out with the device's tuned configs (persistent kernels)."""
    device = torch.device("cuda")
    counts = torch.tensor([300, 0, 517, 64], device=device)
    topology = dk.Topology.for_experts(counts, int(counts.sum()) + 100, 256, 128)
    rows, cols = topology.shape
    s_rows, s_cols = (cols, rows) if transpose else (rows, cols)
    data = torch.randn(topology.data_shape(), device=device).bfloat16()
    b = torch.randn(s_cols, 384, device=device).bfloat16()
    out = torch.full((s_rows, 384), float("nan"), device=device)
    expected = ref.dsd(data.double(), topology, b.double(), transpose)
    dk.ops.dsd(data, topology, b, transpose=transpose, out=out)
    assert not out.isnan().any()
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-5
    assert [(how, where) for _, how, where in tma_launches] == [("store", "strips" if transpose else "pointers")]


@pytest.mark.parametrize("block_n", [128, 256])
def test_wide_out_of_weight_gradients_leaves_in_tma_strips(block_n, device, tma_launches):
    """The flattened weight-gradient kernel writes an fp32 out under fp16 operands through TMA stores
    of 64-column strips (no pointer epilogue); N = 200 leaves the last strip partly past the edge."""
    topology = REGULAR["experts-bs16"](device)
    cfg = dk.DsdConfig(block_n=block_n, block_k=16, group_m=2, persistent=True, flatten=True)
    g = torch.Generator().manual_seed(block_n)
    data = torch.randn(topology.data_shape(), generator=g).to(device).half()
    b = torch.randn(topology.shape[0], 200, generator=g).to(device).half()
    out = torch.full((topology.shape[1], 200), float("nan"), device=device)
    expected = ref.dsd(data.double(), topology, b.double(), True)
    dk.ops.dsd(data, topology, b, transpose=True, out=out, config=cfg)
    assert tma_launches == [("dsdt_tma_kernel", "store", "strips")]
    assert not out.isnan().any()
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-5
