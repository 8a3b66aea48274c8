"""Lightning: ``trainer.fit`` on the loader as it is, ``ModelCheckpoint`` every few steps, resume with ``ckpt_path``.

Lightning saves the loader's ``state_dict()`` in every checkpoint and loads it on ``ckpt_path``;
``zephon_loader.lightning.ZephonLoaderCallback`` (added by the loader when missing) makes that exact: the
resumed run trains the uninterrupted run's batches from the checkpoint on. The model is a stock
``transformers.LlamaForCausalLM`` (tiny, random) on ``examples/train.yaml`` (the ``hf`` contract).

    python examples/lightning_train.py --steps 20 --save-every 10 --out runs/lightning
    python examples/lightning_train.py --steps 20 --out runs/lightning-resumed \\
        --resume "runs/lightning/epoch=0-step=10.ckpt"
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
import transformers

from zephon_loader import build_text_loader, read_loader_config
from zephon_loader.lightning import ZephonLoaderCallback


class CausalLM(pl.LightningModule):
    """A Hugging Face causal LM trained on the loader's batches as they come (``model(**batch).loss``)."""

    def __init__(self, vocab_size: int, sequence_length: int, hidden_size: int, layers: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=sequence_length))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        trained = int((batch["labels"] != -100).sum())
        self.print(f"step {self.global_step + 1} loss {loss.item()} tokens {trained}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("train.yaml"))
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="max_steps")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/lightning"))
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint file written by --save-every")
    args = parser.parse_args()

    pl.seed_everything(0)
    config = read_loader_config(args.config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(config.base_dir) / config.tokenizer.path)
    module = CausalLM(len(tokenizer), config.sequence_length, args.hidden_size, args.layers, args.lr)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_every, save_top_k=-1)
    trainer = pl.Trainer(max_steps=args.steps, callbacks=[ZephonLoaderCallback(), checkpoints],
                         default_root_dir=args.out, logger=False, enable_progress_bar=False)
    with build_text_loader(config) as loader:
        trainer.fit(module, train_dataloaders=loader, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
