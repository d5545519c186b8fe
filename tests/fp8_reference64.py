"""float64 ground truth for the fp8 tests, written independently of dmoe_kernels.fp8: e4m3's grid
from frexp, tiles by explicit loops over slices."""
import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 2.0**-100


def spacing(v):
    """e4m3's spacing at |v| (float64): 2^(e - 3) for 2^e <= |v| < 2^(e+1), e >= -6 (normal), and
    the subnormals' 2^-9 below 2^-6."""
    _, e = torch.frexp(v)  # v = m * 2^e, 0.5 <= |m| < 1, so 2^(e-1) <= |v|
    return torch.ldexp(torch.ones_like(v), (e - 1).clamp_min(-6) - 3)


def round_e4m3(v):
    """v (float64, |v| <= 448) to the nearest e4m3 value, ties to even."""
    s = spacing(v)
    return torch.round(v / s) * s  # v / s is exact (a power of two); torch.round ties to even


def near_midpoint(v, rel=2.0**-22):
    """Where v lies within `rel` of halfway between two e4m3 values: a correctly rounded fp32
    quotient may round either way there."""
    s = spacing(v)
    frac = (v / s).abs() % 1
    return (frac - 0.5).abs() * s <= rel * v.abs()


def quantize_tile(x64):
    """One tile (float64) -> (q float64 values on e4m3's grid, its fp32 scale as float64, v = x / s)."""
    amax = float(x64.abs().max()) if x64.numel() else 0.0
    s = float(torch.tensor(max(amax, AMAX_FLOOR) / E4M3_MAX, dtype=torch.float64).float())
    v = (x64 / s).clamp(-E4M3_MAX, E4M3_MAX)
    return round_e4m3(v), s, v


def quantize_rows64(x, tile=128):
    x64 = x.double().reshape(-1, x.shape[-1])
    k = x64.shape[1]
    q, v = torch.empty_like(x64), torch.empty_like(x64)
    s = torch.empty(x64.shape[0], -(-k // tile), dtype=torch.float64)
    for r in range(x64.shape[0]):
        for t in range(s.shape[1]):
            sl = slice(t * tile, (t + 1) * tile)
            q[r, sl], s[r, t], v[r, sl] = quantize_tile(x64[r, sl])
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], -1), v.reshape(x.shape)


def quantize_blocks64(w, tile=128):
    w64 = w.double()
    q, v = torch.empty_like(w64), torch.empty_like(w64)
    s = torch.empty(-(-w.shape[0] // tile), -(-w.shape[1] // tile), dtype=torch.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            sl = (slice(i * tile, (i + 1) * tile), slice(j * tile, (j + 1) * tile))
            q[sl], s[i, j], v[sl] = quantize_tile(w64[sl])
    return q, s, v
