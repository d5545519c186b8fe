"""dmoe-import's refusals, before any work: a missing file of a model saved in several safetensors
files is named, with the number of tensors model.safetensors.index.json puts in it (and without the
config's warnings, which would follow the checks); several bad keys are one line each."""
import json

import safetensors.torch
import torch
import transformers

from megatron_dmoe.hf_import.cli import import_main


def _mixtral_config(hf):
    transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                               architectures=["MixtralForCausalLM"]).save_pretrained(hf)
    (hf / "tokenizer.json").write_text("{}")


def test_a_missing_file_of_a_sharded_model_is_named(tmp_path, capsys):
    hf = tmp_path / "hf"
    _mixtral_config(hf)
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


def test_several_bad_keys_are_one_line_each(tmp_path, capsys):
    hf = tmp_path / "hf"
    _mixtral_config(hf)
    assert import_main([str(hf), "--run-dir", str(tmp_path / "run"), "data.data_path=data/x_text_document",
                        "training.trian_iters=3", "training.lrr=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "dmoe-import: error: invalid configuration (2 problems):"
    assert [line.split(":")[0].strip() for line in err[1:]] == ["training.trian_iters", "training.lrr"]
    assert not (tmp_path / "run").exists()
