"""`python -m model.convert GGUF_OR_HF_DIR OUT_DIR`: a checkpoint in the Hugging Face layout the policy loads.

The output directory holds config.json, model.safetensors and, when the source has them, tokenizer.json
and tokenizer_config.json (with the chat template). From a GGUF file (`model.gguf_checkpoint`) the
tensors are dequantized to fp32 (or `--dtype`) and the tokenizer is rebuilt from the metadata
(`model.gguf_tokenizer`). From an HF directory the checkpoint is loaded as the policy would load it (so
every config key and tensor is checked) and written back with the tokenizer files copied.

The directory appears whole or not at all: everything is written into a temporary sibling that is
renamed into place last, so a crash never leaves a half-converted checkpoint that a later run would use.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import structlog
import torch

from model.checkpoint import load_checkpoint, staged_directory, to_hf_state_dict, write_checkpoint
from model.errors import CheckpointError, ModelError
from model.gguf_checkpoint import read_gguf
from model.gguf_tokenizer import build_tokenizer, tokenizer_config

__all__ = ["TOKENIZER_FILES", "convert", "copy_tokenizer", "main"]

log = structlog.get_logger(__name__)

# What transformers writes for a tokenizer: copied from an HF source directory when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GGUF_MAGIC = b"GGUF"


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _from_gguf(source: Path, out: Path, dtype: torch.dtype) -> None:
    checkpoint = read_gguf(source)
    tokenizer = build_tokenizer(checkpoint.metadata)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab != checkpoint.config.vocab_size:
        raise CheckpointError(f"{source}: the tokenizer has {vocab} tokens but the embedding has "
                              f"{checkpoint.config.vocab_size} rows")
    write_checkpoint(checkpoint.config, checkpoint.tensors, out, dtype)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(checkpoint.metadata), indent=2))


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer files (and chat template) an HF checkpoint directory has, unchanged; returns their names."""
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, out / name)
    if "tokenizer.json" not in copied:
        log.warning("checkpoint_without_tokenizer", source=str(source), reason="the source has no tokenizer.json")
    return copied


def _from_hf_dir(source: Path, out: Path, dtype: torch.dtype) -> None:
    config, model = load_checkpoint(source, dtype=torch.float32)
    write_checkpoint(config, to_hf_state_dict(model), out, dtype)
    copy_tokenizer(source, out)


def convert(source: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a GGUF file or an HF checkpoint directory into `out_dir` (which must not exist yet).

    Raises:
        CheckpointError: the source is missing, neither GGUF nor a checkpoint directory, or holds a tensor
            or key this converter does not read (named); `out_dir` already exists.
        ConfigError: the source describes a model the policy does not support (the key named).
    """
    src, out = Path(source), Path(out_dir)
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or directory")
    with staged_directory(out) as tmp:
        if src.is_dir():
            _from_hf_dir(src, tmp, dtype)
        elif _is_gguf(src):
            _from_gguf(src, tmp, dtype)
        else:
            raise CheckpointError(f"{src}: neither a GGUF file (magic {_GGUF_MAGIC!r}) nor a checkpoint directory")
    log.info("checkpoint_converted", source=str(src), out=str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.convert", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a .gguf file or a Hugging Face checkpoint directory")
    parser.add_argument("out_dir", help="the directory to create (must not exist)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                        help="tensor dtype written (default float32: GGUF weights dequantize exactly into it)")
    args = parser.parse_args(argv)
    try:
        out = convert(args.source, args.out_dir, _DTYPES[args.dtype])
    except ModelError as exc:
        print(f"model.convert: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
