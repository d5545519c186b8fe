"""dmoe-import and dmoe-export of DeepSeek-V2 and DeepSeek-V3: tiny random models built with
transformers (multi-latent attention, dense first layers, shared experts, group-limited routing;
V2 with YaRN and no query latent, V3 with sigmoid scores and a selection bias) become runs that
compute their logits, generate their greedy tokens, train on, and export back to the same tensors."""
import json
import os
import sys

import pytest
import safetensors.torch
import torch
import transformers

from megatron_dmoe.hf_import.cli import import_main
from megatron_dmoe.inference.generate import generate
from megatron_dmoe.inference.run_model import load_run
from megatron_dmoe.parallel.distributed import destroy_distributed

# importlib import mode: this folder's helper module is imported by name
if os.path.dirname(__file__) not in sys.path:
    sys.path.insert(0, os.path.dirname(__file__))

from hf_models import check_resumed_run_trains_and_exports, logits, our_logits  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
              first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=8, n_shared_experts=2,
              max_position_embeddings=128, initializer_range=0.1)
FAMILIES = {
    # DeepSeek-V2-Lite's shape: no query latent; softmax, a group scored by its best expert (the sum of
    # its best two would choose other groups), YaRN with both mscales
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                    dict(q_lora_rank=None, num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=2,
                         topk_group=1,
                         routed_scaling_factor=1.5,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 0.707, "mscale_all_dim": 0.707})),
    # DeepSeek-V3's: a query latent, sigmoid scores with a selection bias, renormalised, default RoPE
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(q_lora_rank=24, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5)),
}
TRAIN = ["model.seq_length=32", "training.train_iters=5", "training.micro_batch_size=4",
         "training.global_batch_size=4", "training.lr=3e-3", "training.lr_warmup_iters=0",
         "training.lr_decay_style=constant", "training.eval_interval=0", "training.device=cpu",
         "logging.log_interval=1", "logging.progress_bar=off", "logging.tensorboard=false", "logging.plot=false"]


def tiny_deepseek(family, vocab_size, eod):
    """A random transformers DeepSeek model of `family` with norms and selection bias away from
    their initial values (so that a weight mapped to the wrong place shows)."""
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(vocab_size=vocab_size, eos_token_id=eod, bos_token_id=eod, pad_token_id=None,
                          **COMMON, **extra)
    torch.manual_seed(0)
    hf = model_class(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, corpus, tmp_path_factory):
    """(family, transformers model, its directory, the imported run directory)."""
    from megatron_dmoe.export.tokenizer_files import write_tokenizer_files

    prefix, tokenizer = corpus
    hf = tiny_deepseek(request.param, tokenizer.vocab_size, tokenizer.eod)
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "hf")
    if request.param == "deepseek_v3":  # a multi-token-prediction layer's tensor, as DeepSeek's own files have
        assert hf.config.num_nextn_predict_layers == 1
        safetensors.torch.save_file({"model.layers.3.eh_proj.weight": torch.randn(64, 128)},
                                    root / "hf" / "mtp.safetensors")
    write_tokenizer_files(tokenizer, root / "hf", 128)
    status = import_main([str(root / "hf"), "--run-dir", str(root / "run"), f"data.data_path={prefix}", *TRAIN])
    assert status == 0
    return request.param, hf, root / "hf", root / "run"


@pytest.fixture
def tokens(corpus):
    return torch.randint(0, corpus[1].vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def test_imported_run_computes_the_models_logits_and_greedy_tokens(imported, tokens, corpus):
    _, hf, _, run_dir = imported
    tokenizer = corpus[1]
    run = load_run(run_dir, device="cpu")
    try:
        ours = our_logits(run, tokens)
        prompt = tokens[0, :12].tolist()
        generated = generate(run.model, prompt, max_new_tokens=16, context_length=128, eod=tokenizer.eod,
                             vocab_size=tokenizer.vocab_size).tokens
    finally:
        destroy_distributed()
    theirs = logits(hf, tokens)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    if tokenizer.eod in out:
        out = out[:out.index(tokenizer.eod)]
    assert len(generated) >= 8 and generated == out


def test_export_gives_back_the_same_tensors_and_logits(imported, tokens, tmp_path):
    from megatron_dmoe.export.cli import export_main

    _, hf, hf_dir, run_dir = imported
    assert export_main([str(run_dir), str(tmp_path / "out")]) == 0
    before = safetensors.torch.load_file(hf_dir / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == json.loads((hf_dir / "config.json").read_text())["architectures"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    assert torch.equal(logits(back, tokens), logits(hf, tokens))


def test_resumed_run_trains_and_exports(imported, tokens, cli_run, tmp_path):
    family, _, hf_dir, run_dir = imported
    out = check_resumed_run_trains_and_exports(run_dir, tmp_path, cli_run, tokens)
    if family == "deepseek_v3":  # the selection bias moved with the load, and went out with the weights
        before = safetensors.torch.load_file(hf_dir / "model.safetensors")
        after = safetensors.torch.load_file(out / "model.safetensors")
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert not torch.equal(after[bias], before[bias])


@pytest.fixture
def config_dirs(tmp_path):
    """{family: a model directory with config.json and a stand-in tokenizer, no weights}: every
    refusal below comes before weights or tokenizer are read (no corpus: the fast lane runs them)."""
    for family, (config_class, model_class, extra) in FAMILIES.items():
        config_class(vocab_size=256, architectures=[model_class.__name__], **COMMON, **extra).save_pretrained(
            tmp_path / family)
        (tmp_path / family / "tokenizer.json").write_text("{}")
    return {family: tmp_path / family for family in FAMILIES}


@pytest.mark.parametrize("family, changes, named", [
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=false is not supported"),
    ("deepseek_v3", dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 is not supported"),
    ("deepseek_v3", dict(topk_group=1), "topk_group=1 is not supported"),
    ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
    ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    ("deepseek_v3", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     'quantization_config="fp8" is not supported'),
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=true is not supported"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), 'topk_method="noaux_tc" is not supported'),
    ("deepseek_v2", dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    ("deepseek_v2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                          "original_max_position_embeddings": 32, "mscale_all_dim": 1.0}),
     "rope_parameters.mscale=null is not supported"),
    ("deepseek_v2", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
     'rope_parameters.rope_type="linear" is not supported'),
])
def test_an_unsupported_deepseek_config_is_refused_in_one_line(family, changes, named, config_dirs, tmp_path,
                                                               capsys):
    path = config_dirs[family] / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    assert import_main([str(config_dirs[family]), "--run-dir", str(tmp_path / "run"), "data.data_path=x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "run").exists()


def test_export_refuses_a_latent_attention_model_without_a_deepseek_equivalent():
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.export.dmoe_gpt import dmoe_gpt_mismatches
    from megatron_dmoe.export.hf_architecture import DMOE_GPT, hf_architecture
    from megatron_dmoe.inference.errors import UsageError

    mla = ["model.multi_latent_attention=true", "model.position_embedding_type=rope", "model.normalization=RMSNorm",
           "model.activation=swiglu", "model.add_bias_linear=false", "model.qk_layernorm=true",
           "model.norm_epsilon=1e-6", "moe.num_experts=8", "moe.top_k=2", "moe.ffn_hidden_size=16",
           "moe.shared_expert_ffn_hidden_size=32"]
    assert hf_architecture(resolve(load_config(None, mla))) == "deepseek_v2"
    sigmoid = ["moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true"]
    assert hf_architecture(resolve(load_config(None, mla + sigmoid))) == "deepseek_v3"
    with pytest.raises(UsageError, match="as DeepSeek-V3 these settings differ: moe.router_group_score=max"):
        hf_architecture(resolve(load_config(None, mla + sigmoid + [
            "moe.router_num_groups=4", "moe.router_group_topk=1", "moe.router_group_score=max"])))
    with pytest.raises(UsageError, match=r"moe.shared_expert_ffn_hidden_size=0 .*model.norm_epsilon=1e-05"):
        hf_architecture(resolve(load_config(None, mla + ["moe.shared_expert_ffn_hidden_size=0",
                                                         "model.norm_epsilon=1e-5"])))
    # a latent-attention model that Mixtral would compute but for its attention is refused as DeepSeek's
    mixtral_like = mla[:5] + ["moe.num_experts=8", "moe.top_k=2", "moe.router_renormalize=true"]
    with pytest.raises(UsageError, match="as DeepSeek-V2 these settings differ: moe.router_pre_softmax"):
        hf_architecture(resolve(load_config(None, mixtral_like)))
    # our own modeling file has no multi-latent attention: the same model without it is ours
    assert dmoe_gpt_mismatches(resolve(load_config(None, mla)))[0].startswith("model.multi_latent_attention=true")
    assert hf_architecture(resolve(load_config(None, mla[1:]))) == DMOE_GPT


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_on_a_gpu_the_import_computes_the_models_logits_generates_trains_and_exports(family, corpus, cli_run,
                                                                                   tmp_path):
    """The same on one GPU (fp32: the sparse experts' Triton products in IEEE fp32, SDPA's kernels):
    logits within float rounding of transformers' on the GPU, the same greedy tokens, five steps of
    training on the GPU that lower the loss, and an export that transformers computes as we do."""
    from megatron_dmoe.export.cli import export_main
    from megatron_dmoe.export.tokenizer_files import write_tokenizer_files

    prefix, tokenizer = corpus
    hf = tiny_deepseek(family, tokenizer.vocab_size, tokenizer.eod)
    hf.save_pretrained(tmp_path / "hf")
    write_tokenizer_files(tokenizer, tmp_path / "hf", 128)
    train = [arg.replace("training.device=cpu", "training.device=cuda") for arg in TRAIN]
    assert import_main([str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run"), f"data.data_path={prefix}",
                        *train]) == 0
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    hf = hf.cuda()
    prompt = tokens[0, :12].tolist()
    run = load_run(tmp_path / "run", device="cuda")
    try:
        ours = our_logits(run, tokens)
        generated = generate(run.model, prompt, max_new_tokens=16, context_length=128, eod=tokenizer.eod,
                             vocab_size=tokenizer.vocab_size).tokens
    finally:
        destroy_distributed()
    torch.testing.assert_close(ours, logits(hf, tokens), rtol=0, atol=1e-4)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]).cuda(), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    out = out.tolist()
    assert generated == (out[:out.index(tokenizer.eod)] if tokenizer.eod in out else out)

    result = cli_run(tmp_path / "run", "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0], losses
    assert export_main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    run = load_run(tmp_path / "run", device="cuda")
    try:
        ours = our_logits(run, tokens)
    finally:
        destroy_distributed()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval().cuda()
    torch.testing.assert_close(logits(back, tokens), ours, rtol=0, atol=1e-4)
