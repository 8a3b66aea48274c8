"""A plain PyTorch training loop with a stock Hugging Face model, checkpointed and resumed exactly.

The model is ``transformers.LlamaForCausalLM`` (a tiny random one from a config, or ``--model DIR`` for a
pretrained one) and the data the loader's ``hf`` contract (``examples/train.yaml``: the bundled demo corpus
and tokenizer). Every ``--save-every`` steps one checkpoint folder holds all three states together: model
and optimizer (``torch.save``) and the loader (``loader.save_state``). ``--resume FOLDER`` loads them and
continues with exactly the batches and losses the uninterrupted run would have had.

    python examples/train_loop.py --steps 20 --save-every 10 --out runs/loop
    python examples/train_loop.py --steps 20 --resume runs/loop/step-10 --out runs/loop-resumed

Your data: ``--config my.yaml`` (a copy of ``examples/train.yaml`` pointing at your shards and tokenizer).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
import transformers

from zephon_loader import build_text_loader, read_loader_config


def make_model(config_path: Path, model_dir: str | None, hidden_size: int, layers: int) -> torch.nn.Module:
    """``--model DIR`` as is, else a random Llama sized for the YAML's tokenizer and ``sequence_length``."""
    if model_dir:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    config = read_loader_config(config_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(config.base_dir) / config.tokenizer.path)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=config.sequence_length))


def save_checkpoint(folder: Path, step: int, model, optimizer, loader) -> None:
    """Model, optimizer and loader in one folder, written beside it and renamed: a crash keeps the last whole one."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
               partial / "training.pt")
    loader.save_state(partial / "loader.pt")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("train.yaml"))
    parser.add_argument("--model", default=None, help="a pretrained model folder (default: a tiny random Llama)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/loop"))
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint folder (OUT/step-N)")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(args.config, args.model, args.hidden_size, args.layers).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    with build_text_loader(args.config) as loader:
        step = 0
        if args.resume is not None:
            saved = torch.load(args.resume / "training.pt", map_location=device, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            loader.load_state(args.resume / "loader.pt")  # the next batch is the one after step saved["step"]
            step = saved["step"]
        while step < args.steps:
            for batch in loader:  # one pass (epoch); the while loop starts the next
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                loss = model(**batch).loss  # each document attends only to itself
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                trained = int((batch["labels"] != -100).sum())
                print(f"step {step} loss {loss.item()} tokens {trained} epoch {loader.epoch}", flush=True)
                if step % args.save_every == 0:
                    save_checkpoint(args.out / f"step-{step}", step, model, optimizer, loader)
                if step == args.steps:
                    break


if __name__ == "__main__":
    main()
