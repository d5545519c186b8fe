"""Generation: the key-value cache gives the tokens a full recomputation gives; sampling controls."""
import json

import pytest
import torch

from megatron_dmoe.inference.generate import generate
from megatron_dmoe.inference.generate_cli import generate_main
from megatron_dmoe.inference.run_model import load_run
from megatron_dmoe.inference.sampling import Sampling, filter_logits
from megatron_dmoe.parallel.distributed import destroy_distributed


@pytest.fixture
def mixtral(runs):
    yield load_run(runs["mixtral"], device="cpu")
    destroy_distributed()


def _greedy_without_cache(model, prompt, steps, vocab_size):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0, -1].float()
            seq.append(int(logits[:vocab_size].argmax()))
    return seq[len(prompt):]


def test_cached_greedy_generation_equals_recomputing_every_position(mixtral):
    prompt = mixtral.tokenizer.tokenize("def main(argv):\n    ")
    out = generate(mixtral.model, prompt, max_new_tokens=20, context_length=64, eod=-1,
                   vocab_size=mixtral.vocab_size)
    assert out.stop_reason == "max_tokens" and len(out.tokens) == 20
    assert out.tokens == _greedy_without_cache(mixtral.model, prompt, 20, mixtral.vocab_size)


def test_generation_stops_at_end_of_document_and_at_the_context(mixtral):
    prompt = mixtral.tokenizer.tokenize("import os\n")
    free = generate(mixtral.model, prompt, max_new_tokens=5, context_length=64, eod=-1,
                    vocab_size=mixtral.vocab_size)
    stop = free.tokens[2]
    out = generate(mixtral.model, prompt, max_new_tokens=5, context_length=64, eod=stop,
                   vocab_size=mixtral.vocab_size)
    assert out.stop_reason == "eod" and out.tokens == free.tokens[:free.tokens.index(stop)]
    full = generate(mixtral.model, prompt, max_new_tokens=100, context_length=len(prompt) + 3, eod=-1,
                    vocab_size=mixtral.vocab_size)
    assert full.stop_reason == "context" and len(full.tokens) == 3


def test_sampling_is_reproducible_per_seed_and_top_k_1_is_greedy(mixtral):
    prompt = mixtral.tokenizer.tokenize("x = ")
    kwargs = dict(max_new_tokens=12, context_length=64, eod=-1, vocab_size=mixtral.vocab_size)
    hot = Sampling(temperature=5.0)
    runs = [generate(mixtral.model, prompt, sampling=hot, generator=torch.Generator().manual_seed(s), **kwargs)
            for s in (1, 1, 2)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    greedy = generate(mixtral.model, prompt, **kwargs)
    top1 = generate(mixtral.model, prompt, sampling=Sampling(temperature=5.0, top_k=1),
                    generator=torch.Generator().manual_seed(3), **kwargs)
    assert top1.tokens == greedy.tokens


def test_top_k_and_top_p_keep_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert kept(filter_logits(logits, top_p=0.7)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.8)) == [True, True, True, False]
    assert kept(filter_logits(logits, top_k=3, top_p=0.95)) == [True, True, True, False]


def test_generate_command_prints_json_per_prompt(runs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + "import os\n")
    assert generate_main([str(runs["mixtral"]), "--prompts", str(prompts), "--device", "cpu", "--max-tokens", "4",
                          "--json", "--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in lines] == ["def f(x):", "import os"]
    assert all(r["stop_reason"] in ("max_tokens", "eod") and len(r["tokens"]) <= 4 for r in lines)
