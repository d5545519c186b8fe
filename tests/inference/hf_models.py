"""Tiny random transformers models with a tokenizer of their own, made here (no download, no corpus):
what dmoe-import reads in the import tests."""
import torch
import transformers

TEXTS = ["def main(argv):\n    return os.path.join(argv[0], 'x')\n",
         "import os\nprint('hello world', 42)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"]
VOCAB = 320  # the models' rows; the tokenizer has fewer tokens, as real models often do
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.1, pad_token_id=None)


def tiny_tokenizer(out):
    """A byte-level BPE tokenizer (about 300 tokens) trained on TEXTS, saved into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 10, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def save_tiny_model(config_class, model_class, extra, out, seed=0):
    """A random model of `model_class` with COMMON's shape and `extra`, its norms away from 1, saved
    into `out` with tiny_tokenizer's tokenizer; returns the model (eval mode)."""
    tokenizer = tiny_tokenizer(out)
    eod = tokenizer.eos_token_id
    config = config_class(**{**COMMON, "eos_token_id": eod, "bos_token_id": eod, **extra})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):  # transformers starts biases at zero
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return model


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


def our_logits(run, tokens):
    with torch.no_grad():
        return run.model(tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None).float()


def check_resumed_run_trains_and_exports(imported_run, tmp_path, cli_run, tokens):
    """A copy of an imported run (at step 0) resumed for its 5 steps lowers the loss; exported, the
    fine-tuned model computes in transformers what ours does. Returns the export's directory."""
    import json
    import shutil

    from megatron_dmoe.export.cli import export_main
    from megatron_dmoe.inference.run_model import load_run
    from megatron_dmoe.parallel.distributed import destroy_distributed

    run_dir = tmp_path / "run"
    shutil.copytree(imported_run, run_dir)  # the caller's run stays at step 0
    result = cli_run(run_dir, "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0], losses
    assert export_main([str(run_dir), str(tmp_path / "out")]) == 0
    run = load_run(run_dir, device="cpu")
    try:
        ours = our_logits(run, tokens)
    finally:
        destroy_distributed()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(back, tokens), ours, rtol=0, atol=1e-5)
    return tmp_path / "out"
