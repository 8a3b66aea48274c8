"""Accelerate: ``prepare`` with the loader, ``checkpoint_loaders``, ``save_state`` / ``load_state`` resuming exactly.

``accelerator.prepare`` returns the loader unchanged (each process already reads its own lanes);
``checkpoint_loaders(accelerator, loader)`` makes ``accelerator.save_state(folder)`` write each process's
loader position beside the model, optimizer and RNG states, and ``accelerator.load_state(folder)`` restore
it. The model is a stock ``transformers.LlamaForCausalLM`` (tiny, random) on ``examples/train.yaml``.

    python examples/accelerate_train.py --steps 20 --save-every 10 --out runs/accelerate
    python examples/accelerate_train.py --steps 20 --resume runs/accelerate/step_10 --out runs/accelerate-resumed

Data parallel, on GPUs or (with ``ACCELERATE_USE_CPU=1``) on CPU processes::

    torchrun --nproc_per_node 2 examples/accelerate_train.py --steps 20 --save-every 10 --out runs/accelerate-dp
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import send_to_device, set_seed

from zephon_loader import build_text_loader, read_loader_config
from zephon_loader.accelerate import checkpoint_loaders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("train.yaml"))
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/accelerate"))
    parser.add_argument("--resume", type=Path, default=None, help="a folder written by --save-every (OUT/step_N)")
    args = parser.parse_args()

    accelerator = Accelerator()  # first: the loader takes its data-parallel rank from the process group
    set_seed(0)
    config = read_loader_config(args.config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(config.base_dir) / config.tokenizer.path)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=4, max_position_embeddings=config.sequence_length))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    with build_text_loader(config) as loader:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        checkpoint_loaders(accelerator, loader)  # save_state/load_state now carry each process's loader position
        step = 0
        if args.resume is not None:
            accelerator.load_state(args.resume)
            step = int(args.resume.name.removeprefix("step_"))
        model.train()
        while step < args.steps:
            for batch in loader:  # one pass (epoch); the while loop starts the next
                batch = send_to_device(batch, accelerator.device)
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                trained = int((batch["labels"] != -100).sum())
                print(f"rank {accelerator.process_index} step {step} loss {loss.item()} tokens {trained}", flush=True)
                if step % args.save_every == 0:
                    accelerator.save_state(args.out / f"step_{step}")
                if step == args.steps:
                    break
    accelerator.end_training()


if __name__ == "__main__":
    main()
