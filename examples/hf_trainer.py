"""Hugging Face Trainer: ``ZephonTrainer`` with ``max_steps``, ``save_strategy="steps"``, ``resume_from_checkpoint``.

``zephon_loader.hf.ZephonTrainer`` is ``transformers.Trainer`` taking ``train_loader=`` instead of
``train_dataset=``: batches reach the model as the loader yields them, every checkpoint folder also holds
the loader's state, and ``train(resume_from_checkpoint=...)`` continues with exactly the batches, losses and
weights of the uninterrupted run. The model is a stock ``transformers.LlamaForCausalLM`` (tiny, random) on
``examples/train.yaml`` (the ``hf`` contract). The loader has no ``len()``: train by ``max_steps``.

    python examples/hf_trainer.py --steps 20 --save-every 10 --out runs/hf
    python examples/hf_trainer.py --steps 20 --save-every 10 --out runs/hf --resume runs/hf/checkpoint-10

``--resume last`` takes the newest checkpoint in ``--out``. Losses are in ``OUT/checkpoint-N/trainer_state.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import transformers

from zephon_loader import build_text_loader, read_loader_config
from zephon_loader.hf import ZephonTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("train.yaml"))
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="max_steps")
    parser.add_argument("--save-every", type=int, default=10, help="save_steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/hf"))
    parser.add_argument("--resume", default=None, help="a checkpoint folder, or 'last' for the newest in --out")
    args = parser.parse_args()

    transformers.set_seed(0)
    config = read_loader_config(args.config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(config.base_dir) / config.tokenizer.path)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(  # or AutoModelForCausalLM.from_pretrained(...)
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=4, max_position_embeddings=config.sequence_length,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    training_args = transformers.TrainingArguments(
        output_dir=str(args.out), max_steps=args.steps, save_strategy="steps", save_steps=args.save_every,
        learning_rate=args.lr, logging_steps=1, report_to=[], disable_tqdm=True)
    resume = True if args.resume == "last" else args.resume

    with build_text_loader(config) as loader:
        trainer = ZephonTrainer(model=model, args=training_args, train_loader=loader, processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
