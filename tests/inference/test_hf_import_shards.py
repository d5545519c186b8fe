"""dmoe-import of a model saved in several safetensors files: one of them missing is named, with the
number of tensors model.safetensors.index.json puts in it, before any work (and without the
config's warnings, which would follow the checks)."""
import json

import safetensors.torch
import torch
import transformers

from megatron_dmoe.hf_import.cli import import_main


def test_a_missing_file_of_a_sharded_model_is_named(tmp_path, capsys):
    hf = tmp_path / "hf"
    transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                               architectures=["MixtralForCausalLM"]).save_pretrained(hf)
    (hf / "tokenizer.json").write_text("{}")
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    weight_map = {f"t{n}": files[n % 3] for n in range(9)}
    for name in files[:2]:  # the third is missing
        safetensors.torch.save_file({t: torch.zeros(1) for t, f in weight_map.items() if f == name}, hf / name)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # the warm-up warning these keys raise is held until every check has passed: the refusal is alone
    assert import_main([str(hf), "--run-dir", str(tmp_path / "run"), "data.data_path=data/x_text_document",
                        "training.train_iters=150", "training.lr_warmup_iters=200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dmoe-import: error: {hf / files[2]} is missing: model.safetensors.index.json names it for 3 "
                   "tensors; copy the model directory whole"]
    assert not (tmp_path / "run").exists()
