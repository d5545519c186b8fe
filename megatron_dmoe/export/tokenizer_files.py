"""The run's tokenizer as files transformers loads offline: a sentencepiece model, or the folder of
a transformers tokenizer (a run made by dmoe-import) copied as it is.

transformers' LlamaTokenizer converts a sentencepiece BPE model (tokenizer.model) into its own
byte-fallback BPE; with no prefix space and no added BOS/EOS it gives our token ids (checked by the
tests on the built-in tokenizer). It would mis-read a unigram model, so those are refused.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List, Optional

from megatron_dmoe.inference.errors import UsageError

_BPE = 2  # sentencepiece's TrainerSpec.ModelType


def _varint(data: bytes, i: int):
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes):
    """(field number, wire type, value) of a serialized protobuf message, top level only."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = data[i:i + size], i + size
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield number, wire, value


def sentencepiece_model_type(proto: bytes) -> int:
    """ModelProto.trainer_spec (field 2).model_type (field 3); 1 unigram (the default), 2 BPE."""
    for number, wire, value in _fields(proto):
        if number == 2 and wire == 2:
            for sub, sub_wire, sub_value in _fields(value):
                if sub == 3 and sub_wire == 0:
                    return sub_value
    return 1


def check_exportable_tokenizer(tokenizer) -> None:
    if sentencepiece_model_type(Path(tokenizer.path).read_bytes()) != _BPE:
        raise UsageError(f"the run's tokenizer {tokenizer.path} is not a sentencepiece BPE model: transformers' "
                         "LlamaTokenizer would read it differently; train a BPE tokenizer "
                         "(tools/train_tokenizer.py's default)")


def write_tokenizer_files(tokenizer, out: Path, context_length: int) -> None:
    """tokenizer.model, tokenizer_config.json and special_tokens_map.json into `out`."""
    shutil.copyfile(tokenizer.path, out / "tokenizer.model")
    special = {}
    for name, attr in (("unk_token", "unk"), ("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "pad")):
        try:
            special[name] = tokenizer.inv_vocab[getattr(tokenizer, attr)]
        except NotImplementedError:
            pass
    config = {
        "tokenizer_class": "LlamaTokenizer",
        # our tokenizer encodes text as it is: no BOS/EOS added, no space prepended
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# A transformers tokenizer folder's files (any of them), as dmoe-import copies them into a run and
# dmoe-export back out
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def hf_tokenizer_folder(cfg) -> Optional[Path]:
    """The local transformers tokenizer folder a run reads (data.tokenizer_type HuggingFaceTokenizer),
    or None for other tokenizers."""
    data = cfg.data
    if data.tokenizer_type != "HuggingFaceTokenizer" or not data.tokenizer_model:
        return None
    folder = Path(data.tokenizer_model).expanduser()
    return folder if folder.is_dir() else None


def copy_tokenizer_folder(folder: Path, out: Path) -> List[str]:
    """Copy the tokenizer files of `folder` into `out`; the names copied."""
    names = [name for name in HF_TOKENIZER_FILES if (Path(folder) / name).is_file()]
    for name in names:
        shutil.copyfile(Path(folder) / name, Path(out) / name)
    return names
