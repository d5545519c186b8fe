"""FLOPs per token against hand counts, torch's FLOP counter and parameter counts."""
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_dmoe.config.schema import RunConfig
from megatron_dmoe.training.flops import mfu, model_flops_per_token


def make_cfg(**sections):
    cfg = RunConfig()
    for section, values in sections.items():
        for key, value in values.items():
            assert hasattr(getattr(cfg, section), key), f"{section}.{key}"
            setattr(getattr(cfg, section), key, value)
    return cfg


def test_hand_count_moe_swiglu_gqa():
    cfg = make_cfg(
        model=dict(num_layers=3, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                   ffn_hidden_size=16, seq_length=4, activation="swiglu"),
        moe=dict(num_experts=4, top_k=2, layer_freq=2, ffn_hidden_size=12))
    # Multiply-accumulates per token, forward. head_dim = 8 / 2 = 4, one key/value group.
    attention_macs = 8 * 8 + 2 * (8 * 1 * 4) + 8 * 8  # q, k and v, output = 192
    scores_flops = 2 * 2 * 4 * 8  # Q.K^T and P.V over 4 positions = 128
    dense_macs = 3 * 8 * 16  # swiglu: gate, up, down = 384
    moe_macs = 2 * 3 * 8 * 12 + 8 * 4  # two experts of width 12, router over 4 experts = 608
    logits_macs = 8 * 10
    # Layers 0 and 2 are MoE (layer_freq 2), layer 1 is dense.
    forward = (3 * (2 * attention_macs + scores_flops) + 2 * dense_macs + 2 * 2 * moe_macs
               + 2 * logits_macs)
    assert forward == 4896
    assert model_flops_per_token(cfg, vocab_size=10) == 3 * 4896


def test_shared_expert_and_its_gate_are_counted():
    model = dict(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, seq_length=4,
                 activation="swiglu")
    plain = model_flops_per_token(make_cfg(model=model, moe=dict(num_experts=4, top_k=2)), vocab_size=10)
    shared = make_cfg(model=model, moe=dict(num_experts=4, top_k=2, shared_expert_ffn_hidden_size=12,
                                            shared_expert_gate=True))
    # per MoE layer, forward: 3 matrices of 8 x 12 and the gate's 8, as multiply-accumulates
    assert model_flops_per_token(shared, vocab_size=10) == plain + 3 * 2 * 2 * (3 * 8 * 12 + 8)


def test_hand_count_multi_latent_attention():
    cfg = make_cfg(model=dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, ffn_hidden_size=32,
                              activation="gelu", multi_latent_attention=True, position_embedding_type="rope",
                              q_lora_rank=6, kv_lora_rank=4, qk_head_dim=3, qk_pos_emb_head_dim=2, v_head_dim=5))
    # multiply-accumulates per token: q down 16 x 6, q up 6 x 2 * (3 + 2), kv down 16 x (4 + 2),
    # kv up 4 x 2 * (3 + 5), output 2 * 5 x 16 = 96 + 60 + 96 + 64 + 160
    projections = 476
    scores = 2 * 8 * (2 * (3 + 2) + 2 * 5)  # Q.K^T at the query/key width, P.V at the value width
    forward = 2 * projections + scores + 2 * 2 * 16 * 32 + 2 * 16 * 10
    assert model_flops_per_token(cfg, vocab_size=10) == 3 * forward
    without_latent = make_cfg(model={**vars(cfg.model), "q_lora_rank": None})
    assert model_flops_per_token(without_latent, vocab_size=10) == 3 * (forward + 2 * (16 * 10 - 96 - 60))


def test_hand_count_dense_gelu_defaults():
    # ffn_hidden_size None = 4 * hidden = 64; num_query_groups None = multi-head.
    cfg = make_cfg(model=dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                              activation="gelu", vocab_size=32))
    per_layer = 2 * (4 * 16 * 16) + 2 * 2 * 8 * 16 + 2 * (2 * 16 * 64)  # 2048 + 512 + 4096
    forward = 2 * per_layer + 2 * 16 * 32
    assert forward == 14336
    assert model_flops_per_token(cfg) == 3 * 14336  # vocab from model.vocab_size


class TinyGPT(torch.nn.Module):
    """Bias-free GPT-shaped model with explicit matmuls, so torch's FLOP counter sees every term."""

    def __init__(self, cfg: RunConfig, vocab: int):
        super().__init__()
        m, moe = cfg.model, cfg.moe
        h, heads = m.hidden_size, m.num_attention_heads
        self.heads, self.groups = heads, m.num_query_groups or heads
        self.head_dim, self.top_k, self.swiglu = h // heads, moe.top_k, m.activation == "swiglu"
        ffn = m.ffn_hidden_size or 4 * h
        expert_ffn = moe.ffn_hidden_size or ffn
        def lin(i, o):
            return torch.nn.Linear(i, o, bias=False, dtype=torch.float64)

        self.layers = torch.nn.ModuleList()
        for index in range(m.num_layers):
            layer = torch.nn.ModuleDict(dict(
                q=lin(h, h), k=lin(h, self.groups * self.head_dim),
                v=lin(h, self.groups * self.head_dim), o=lin(h, h)))
            width = expert_ffn if self.is_moe(cfg, index) else ffn
            mlps = moe.num_experts if self.is_moe(cfg, index) else 1
            layer["experts"] = torch.nn.ModuleList(self.mlp(lin, h, width) for _ in range(mlps))
            if self.is_moe(cfg, index):
                layer["router"] = lin(h, moe.num_experts)
            self.layers.append(layer)
        self.output = lin(h, vocab)

    @staticmethod
    def is_moe(cfg, index):
        return cfg.moe.num_experts > 0 and index % cfg.moe.layer_freq == 0 and index >= cfg.moe.first_dense_layers

    def mlp(self, lin, h, width):
        names = ("gate", "up", "down") if self.swiglu else ("up", "down")
        return torch.nn.ModuleDict(
            {n: lin(width, h) if n == "down" else lin(h, width) for n in names})

    def run_mlp(self, mlp, x):
        a = torch.nn.functional.silu(mlp["gate"](x)) * mlp["up"](x) if self.swiglu else \
            torch.nn.functional.gelu(mlp["up"](x))
        return mlp["down"](a)

    def forward(self, x):  # x: [tokens, hidden], one sequence
        s = x.shape[0]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        for layer in self.layers:
            q = layer["q"](x).view(s, self.heads, self.head_dim).transpose(0, 1)
            repeat = self.heads // self.groups
            k, v = (layer[n](x).view(s, self.groups, self.head_dim).transpose(0, 1)
                    .repeat_interleave(repeat, 0) for n in ("k", "v"))
            scores = (q @ k.transpose(1, 2)).masked_fill(~causal, float("-inf"))
            attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, -1)
            x = x + layer["o"](attended)
            if "router" in layer:
                probs = layer["router"](x).softmax(-1)
                weights, chosen = probs.topk(self.top_k, dim=-1)
                out = torch.zeros_like(x)
                for e, expert in enumerate(layer["experts"]):
                    token, slot = (chosen == e).nonzero(as_tuple=True)
                    y = self.run_mlp(expert, x[token]) * weights[token, slot, None]
                    out = out.index_add(0, token, y)
                x = x + out
            else:
                x = x + self.run_mlp(layer["experts"][0], x)
        return self.output(x)


def random_cfg(rng: random.Random) -> RunConfig:
    heads = rng.choice([2, 4])
    num_experts = rng.choice([0, 2, 4])
    num_layers, layer_freq = rng.randint(1, 4), rng.randint(1, 3)
    return make_cfg(
        model=dict(num_layers=num_layers, hidden_size=heads * rng.choice([4, 8]),
                   num_attention_heads=heads, num_query_groups=rng.choice([None, 1, heads // 2]),
                   ffn_hidden_size=rng.choice([None, 24]), seq_length=rng.choice([8, 16]),
                   activation=rng.choice(["gelu", "swiglu"])),
        moe=dict(num_experts=num_experts, top_k=rng.randint(1, max(1, num_experts)),
                 layer_freq=layer_freq, ffn_hidden_size=rng.choice([None, 20]),
                 # dense first layers, as long as one MoE layer is left
                 first_dense_layers=rng.choice([0, 1]) if num_layers > layer_freq else 0))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.slow
def test_matches_torch_flop_counter_forward_and_backward(seed):
    rng = random.Random(seed)
    cfg, vocab = random_cfg(rng), rng.randint(10, 50)
    torch.manual_seed(seed)
    model = TinyGPT(cfg, vocab)
    x = torch.randn(cfg.model.seq_length, cfg.model.hidden_size, dtype=torch.float64,
                    requires_grad=True)  # the embedding output: its gradient is computed too
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).square().sum().backward()
    assert model_flops_per_token(cfg, vocab) == counter.get_total_flops() / cfg.model.seq_length


@pytest.mark.parametrize("seed", range(6))
def test_matches_active_parameter_count(seed):
    rng = random.Random(100 + seed)
    cfg, vocab = random_cfg(rng), rng.randint(10, 50)
    model = TinyGPT(cfg, vocab)
    active = sum(p.numel() for p in model.parameters())
    for index, layer in enumerate(model.layers):
        if "router" in layer:  # only top_k of the experts work on each token
            per_expert = sum(p.numel() for p in layer["experts"][0].parameters())
            active -= (cfg.moe.num_experts - cfg.moe.top_k) * per_expert
    m = cfg.model
    scores = 2 * 2 * m.seq_length * m.hidden_size * m.num_layers
    assert model_flops_per_token(cfg, vocab) == 3 * (2 * active + scores)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("layer_freq", [1, 2])
def test_top1_moe_equals_dense_plus_router(activation, layer_freq):
    model = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                 seq_length=16, activation=activation)
    dense = model_flops_per_token(make_cfg(model=model), vocab_size=100)
    moe = model_flops_per_token(
        make_cfg(model=model, moe=dict(num_experts=8, top_k=1, layer_freq=layer_freq)), 100)
    moe_layers = len(range(0, 4, layer_freq))
    assert moe == dense + 3 * 2 * 32 * 8 * moe_layers


def test_swiglu_adds_one_matrix_per_mlp():
    model = dict(num_layers=3, hidden_size=16, num_attention_heads=2, ffn_hidden_size=40)
    moe = dict(num_experts=4, top_k=2, layer_freq=2, ffn_hidden_size=24)
    flops = {act: model_flops_per_token(make_cfg(model=dict(model, activation=act), moe=moe), 64)
             for act in ("gelu", "swiglu")}
    # One dense layer (1) with width 40, two MoE layers (0, 2) with two active experts of width 24.
    assert flops["swiglu"] - flops["gelu"] == 3 * 2 * 16 * (40 + 2 * 2 * 24)


def test_user_errors_name_the_key():
    with pytest.raises(ValueError, match="vocab_size"):
        model_flops_per_token(RunConfig())
    with pytest.raises(ValueError, match="model.activation"):
        model_flops_per_token(make_cfg(model=dict(activation="relu")), 10)
    with pytest.raises(ValueError, match="model.num_attention_heads"):
        model_flops_per_token(make_cfg(model=dict(hidden_size=30, num_attention_heads=4)), 10)
    with pytest.raises(ValueError, match="moe.layer_freq"):
        model_flops_per_token(make_cfg(moe=dict(num_experts=2, layer_freq=0)), 10)


def test_config_is_not_modified():
    cfg = RunConfig()
    model_flops_per_token(cfg, 10)
    assert cfg.model.ffn_hidden_size is None and cfg.moe.ffn_hidden_size is None


def test_mfu_and_throughput():
    assert mfu(123.0, 400.0) == pytest.approx(0.3075)
    with pytest.raises(ValueError, match="peak_tflops"):
        mfu(1.0, 0.0)
