"""ZephonTrainer runs by passes ("epoch" strategies), for tests/test_hf_trainer_epochs.py (1 process, or torchrun).

``python hf_trainer_worker.py OUT PHASE JSON``: trains a tiny random
``LlamaForCausalLM`` on the bundled demo (S=256, B=8: 59 batches a pass at one process, 30 at two
batches per rank) with ``TrainingArguments`` from JSON (plus ``resume``: a
checkpoint folder; ``loader``: keys over the loader config, e.g. ``distributed``), and writes
``OUT/PHASE_rank{r}.json``: the sha1 of each training micro-batch's ``input_ids`` in order (``seen``; ``rows``:
of each row), the global steps its checkpoints were saved at, and the lanes each checkpoint's file of this rank
holds (``lanes``: ``None`` for a state of every lane).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from zephon_loader import build_text_loader
from zephon_loader.hf import ZephonTrainer
from lightning_worker import demo_config


def loader_config(**overrides: Any) -> dict[str, Any]:
    return demo_config(**{"sequence_length": 256, "micro_batch_size": 8, "contract": {"attn_implementation": "hf"},
                          **overrides})


def tiny_llama(vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=256, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def run(out: Path, phase: str, options: dict[str, Any]) -> dict[str, Any]:
    resume = options.pop("resume", None)
    with_eval = options.pop("eval", False)
    overrides = options.pop("loader", {})
    args = transformers.TrainingArguments(
        output_dir=str(out / phase), learning_rate=1e-3, report_to=[], use_cpu=True, disable_tqdm=True, seed=1,
        logging_steps=1, save_only_model=False, **options)
    rank = int(os.environ.get("RANK", "0"))
    with build_text_loader(loader_config(**overrides)) as loader:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(Path(loader_config()["base_dir"]) / "tokenizer"))
        model = tiny_llama(len(tokenizer))
        seen: list[str] = []
        rows: list[str] = []

        def hook(module: Any, args: Any, kwargs: Any) -> None:
            if module.training:
                seen.append(hashlib.sha1(kwargs["input_ids"].numpy().tobytes()).hexdigest()[:16])
                rows.extend(hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in kwargs["input_ids"])

        model.register_forward_pre_hook(hook, with_kwargs=True)
        evaluation = build_text_loader(demo_config(sequence_length=256, micro_batch_size=8, shuffle=False,
                                                   mixture="once", contract={"attn_implementation": "hf"})) \
            if with_eval else None
        trainer = ZephonTrainer(model=model, args=args, train_loader=loader, eval_loader=evaluation)
        trainer.train(resume_from_checkpoint=resume)
        evaluated = [entry["step"] for entry in trainer.state.log_history if "eval_loss" in entry]
        if evaluation is not None:
            evaluation.close()
        folder = out / phase
        saved = sorted(int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*")) if folder.is_dir() else []
        ended, lanes = {}, {}
        for step in saved:
            state = json.loads((folder / f"checkpoint-{step}" / f"zephon_loader_state_rank{rank}.json").read_text())
            ended[step] = [state["loader"]["epoch"], state["loader"]["pass_ended"]]
            lanes[step] = state["loader"].get("lanes")
    record = {"seen": seen, "rows": rows, "saved": saved, "ended": ended, "lanes": lanes,
              "global_step": trainer.state.global_step, "evaluated": evaluated}
    (out / f"{phase}_rank{rank}.json").write_text(json.dumps(record))
    return json.loads(json.dumps(record))  # as the file holds it (string keys)


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
