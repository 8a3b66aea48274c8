"""HF Trainer on a ZephonLoader (issue 10 item 4): exact resume, no re-wrapping, labels as next-token targets.

A tiny random ``LlamaForCausalLM`` (local config) trains 8 optimizer steps
with gradient accumulation 2 and checkpoints every 3; the stream is short
enough that the run crosses a pass boundary. Every test compares with that
uninterrupted run. Two pairings a stock HF model reads correctly: the ``hf``
contract (no mask: transformers derives it from ``position_ids``) with eager
attention, and the default ``block_causal`` contract with SDPA (HF's SDPA path
takes the bool ``[B,1,S,S]`` mask; its eager path would add it to the scores).
"""

from __future__ import annotations

import json
import os
import shutil
from itertools import islice
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from conftest import make_texts, write_jsonl_shards  # noqa: E402
from zephon_loader import build_text_loader  # noqa: E402
from zephon_loader.integrations.hf import STATE_FILE, TrainerBatches, ZephonTrainer  # noqa: E402

MAX_STEPS, ACCUMULATION, SAVE_STEPS = 8, 2, 3
MICRO_BATCHES = MAX_STEPS * ACCUMULATION


#: (loader contract, model attention implementation)
PAIRINGS = {"hf-eager": ({"attn_implementation": "hf"}, "eager"), "block_causal-sdpa": (None, "sdpa")}


@pytest.fixture(scope="module")
def loader_config(tmp_path_factory, tokenizer_dir):
    """The default (block_causal) contract; the model runs SDPA."""
    source = write_jsonl_shards(
        tmp_path_factory.mktemp("hf_trainer_src"), [{"text": t} for t in make_texts(30, seed=11)], shards=2
    )
    return {
        "sources": [{"name": "s", "path": str(source), "weight": 1.0}],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "seed": 5,
        "packing": {"algorithm": "wrap"},  # every token delivered: nothing dropped between passes
        "runtime": {"runner": "threads"},
    }


@pytest.fixture(scope="module", params=sorted(PAIRINGS))
def pairing(request, loader_config):
    """(loader config, model attention implementation) for each pairing."""
    contract, attention = PAIRINGS[request.param]
    return (loader_config if contract is None else dict(loader_config, contract=contract)), attention


def tiny_llama(vocab_size: int, attention: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attention,
    )
    return transformers.LlamaForCausalLM(config)


def training_args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir), max_steps=MAX_STEPS, gradient_accumulation_steps=ACCUMULATION,
        save_strategy="steps", save_steps=SAVE_STEPS, learning_rate=1e-3, logging_steps=1, report_to=[],
        use_cpu=True, disable_tqdm=True, seed=1,
    )
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def record_inputs(model) -> list[torch.Tensor]:
    """The ``input_ids`` of every training forward, in order."""
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        if module.training:
            seen.append(kwargs["input_ids"].detach().clone())

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def record_set_epoch(loader) -> list[int]:
    """Calls of ``loader.set_epoch`` (forwarded to the loader's own, when it has one)."""
    calls: list[int] = []
    original = getattr(loader, "set_epoch", None)

    def set_epoch(epoch):
        calls.append(epoch)
        if original is not None:
            original(epoch)

    loader.set_epoch = set_epoch
    return calls


def train(loader_config, vocab_size, output_dir, resume=None, trainer_cls=ZephonTrainer, attention="sdpa",
          **arg_overrides):
    """One run in a fresh process-like setup: new loader, new model, new trainer."""
    with build_text_loader(loader_config) as loader:
        model = tiny_llama(vocab_size, attention)
        seen = record_inputs(model)
        epochs = record_set_epoch(loader)
        args = training_args(output_dir, **arg_overrides)
        if trainer_cls is ZephonTrainer:
            trainer = ZephonTrainer(model=model, args=args, train_loader=loader)
        else:
            trainer = trainer_cls(loader, model=model, args=args)
        trainer.train(resume_from_checkpoint=resume)
        logs = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
        return seen, epochs, {k: v.detach().clone() for k, v in model.state_dict().items()}, logs


@pytest.fixture(scope="module")
def vocab_size(tokenizer):
    return len(tokenizer)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, pairing, vocab_size):
    config, attention = pairing
    output_dir = tmp_path_factory.mktemp("hf_run")
    seen, epochs, weights, logs = train(config, vocab_size, output_dir, attention=attention)
    return {"dir": output_dir, "seen": seen, "epochs": epochs, "weights": weights, "logs": logs, "config": config,
            "attention": attention}


@pytest.fixture(scope="module")
def two_passes(loader_config):
    """The loader's own stream: its first pass, then its second (the next epoch).

    ``input_ids`` do not depend on the contract, so one read serves both pairings.
    """
    with build_text_loader(loader_config) as loader:
        first = [b["input_ids"] for b in loader]
        second = [b["input_ids"] for b in loader]
    return first, second


def assert_same_batches(seen, expected):
    assert len(seen) == len(expected)
    for index, (got, want) in enumerate(zip(seen, expected)):
        assert torch.equal(got, want), f"micro-batch {index} differs"


def test_training_reads_the_loader_stream_across_passes(uninterrupted, two_passes):
    first, second = two_passes
    # The run crosses a pass boundary between the two checkpoints the resume tests use.
    assert SAVE_STEPS * ACCUMULATION < len(first) < 2 * SAVE_STEPS * ACCUMULATION
    # Exactly the loader's batches, in order, passes chained: nothing re-wrapped, skipped or repeated.
    assert_same_batches(uninterrupted["seen"], (first + second)[:MICRO_BATCHES])
    # A fresh train() starts at epoch 0; the Trainer's own epoch number never reaches the loader.
    assert uninterrupted["epochs"] == [0]
    for step in (3, 6, 8):
        state = json.loads((uninterrupted["dir"] / f"checkpoint-{step}" / STATE_FILE.format(rank=0)).read_text())
        assert state["global_step"] == step and state["loader"]["format"].startswith("zephon_loader.state/")


@pytest.mark.parametrize("step", [3, 6])
def test_resume_continues_with_the_batches_after_the_checkpoint(uninterrupted, vocab_size, tmp_path, step):
    checkpoint = uninterrupted["dir"] / f"checkpoint-{step}"
    seen, epochs, weights, logs = train(uninterrupted["config"], vocab_size, tmp_path, resume=str(checkpoint),
                                        attention=uninterrupted["attention"])
    assert_same_batches(seen, uninterrupted["seen"][step * ACCUMULATION :])
    assert epochs == []  # the loaded state carries the epoch; nothing overrides it
    for name, value in uninterrupted["weights"].items():  # same batches, optimizer and RNG: the same model
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    # The same logged loss and epoch at every step after the checkpoint.
    logged_after = {at: entry for at, entry in logs.items() if at > step}  # the resumed state holds earlier ones
    assert logged_after == {at: entry for at, entry in uninterrupted["logs"].items() if at > step}
    assert len(logged_after) == MAX_STEPS - step


class NaiveTrainer(transformers.Trainer):
    """What one writes without ZephonTrainer: hand the loader to the Trainer, let its resume do the rest."""

    def __init__(self, loader, **kwargs):
        super().__init__(**kwargs)
        self.loader = loader

    def get_train_dataloader(self):
        return self.loader


def test_a_plain_trainer_cannot_resume_this_loader(uninterrupted, vocab_size, tmp_path):
    loader_config, attention = uninterrupted["config"], uninterrupted["attention"]
    checkpoint = str(uninterrupted["dir"] / f"checkpoint-{SAVE_STEPS}")
    # Its default resume fast-forwards with accelerate's skip_first_batches, which rebuilds a DataLoader: refused,
    # naming the fix.
    with pytest.raises(AttributeError, match=r"skip_first_batches.*resumes itself.*ZephonTrainer"):
        train(loader_config, vocab_size, tmp_path / "a", resume=checkpoint, trainer_cls=NaiveTrainer,
              attention=attention, per_device_train_batch_size=2)
    # Without data skipping it restarts the stream: the loader warns that nothing checkpoints it, and the
    # comparison with the uninterrupted run catches the restart.
    with pytest.warns(RuntimeWarning, match="does not checkpoint it"):
        seen, _, _, _ = train(loader_config, vocab_size, tmp_path / "b", resume=checkpoint, trainer_cls=NaiveTrainer,
                              attention=attention, per_device_train_batch_size=2, ignore_data_skip=True)
    assert not torch.equal(seen[0], uninterrupted["seen"][SAVE_STEPS * ACCUMULATION])
    assert torch.equal(seen[0], uninterrupted["seen"][0])


def test_a_stock_trainer_given_the_loader_as_its_dataset_names_zephon_trainer(loader_config, vocab_size, tmp_path):
    with build_text_loader(loader_config) as loader:
        trainer = transformers.Trainer(model=tiny_llama(vocab_size), args=training_args(tmp_path),
                                       train_dataset=loader)
        with pytest.raises(TypeError, match=r"no len\(\).*ZephonTrainer\(train_loader=loader"):
            trainer.train()


def test_resume_refuses_a_checkpoint_without_or_with_a_foreign_loader_state(uninterrupted, vocab_size, tmp_path):
    loader_config = uninterrupted["config"]
    bare = tmp_path / "checkpoint-3"
    shutil.copytree(uninterrupted["dir"] / "checkpoint-3", bare)
    (bare / STATE_FILE.format(rank=0)).unlink()
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .*zephon_loader_state_rank0\.json"):
        train(loader_config, vocab_size, tmp_path / "out", resume=str(bare))
    shutil.copy(uninterrupted["dir"] / "checkpoint-6" / STATE_FILE.format(rank=0), bare / STATE_FILE.format(rank=0))
    with pytest.raises(ValueError, match=r"global_step: got 6, expected 3"):
        train(loader_config, vocab_size, tmp_path / "out", resume=str(bare))


def test_resume_without_a_train_loader_names_it(uninterrupted, vocab_size, tmp_path):
    """An evaluation-only trainer asked to resume training: the error names train_loader= (resume_from_checkpoint
    asks the train loader's distributed.state_scope, which there is none to ask)."""
    with build_text_loader(uninterrupted["config"]) as eval_loader:
        trainer = ZephonTrainer(model=tiny_llama(vocab_size, uninterrupted["attention"]),
                                args=training_args(tmp_path), eval_loader=eval_loader)
        with pytest.raises(ValueError, match=r"training needs train_loader="):
            trainer.train(resume_from_checkpoint=str(uninterrupted["dir"] / f"checkpoint-{SAVE_STEPS}"))


def test_loss_takes_the_loader_labels_as_next_token_targets(loader_config, vocab_size, tmp_path):
    model = tiny_llama(vocab_size)
    with build_text_loader(loader_config) as loader:
        trainer = ZephonTrainer(model=model, args=training_args(tmp_path), train_loader=loader)
        raw = next(iter(loader))
        batch = next(iter(trainer.get_train_dataloader()))
    assert batch["shift_labels"] is batch["labels"]  # the same tensor under HF's name, not a copy
    assert batch.keys() - {"shift_labels"} == raw.keys() and torch.equal(batch["labels"], raw["labels"])
    model.train()
    with torch.no_grad():
        out = model(**batch)
        reference = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, vocab_size), raw["labels"].reshape(-1), ignore_index=-100
        )
        double_shifted = model(**raw).loss  # what a stock Trainer computes from the loader's labels
    torch.testing.assert_close(out.loss, reference)
    assert not torch.allclose(double_shifted, reference)


def test_evaluation_reads_one_whole_pass_of_epoch_0(loader_config, vocab_size, tmp_path, two_passes):
    model = tiny_llama(vocab_size)
    with build_text_loader(loader_config) as train_loader, build_text_loader(loader_config) as eval_loader:
        epochs = record_set_epoch(eval_loader)
        trainer = ZephonTrainer(
            model=model, args=training_args(tmp_path, per_device_eval_batch_size=7),
            train_loader=train_loader, eval_loader={"held": eval_loader},
        )
        seen = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"]), with_kwargs=True)
        first = trainer.evaluate()
        second = trainer.evaluate()
    assert epochs == [0, 0]
    assert_same_batches(seen, two_passes[0] + two_passes[0])
    assert first["eval_held_loss"] == second["eval_held_loss"]
    assert trainer.args.per_device_eval_batch_size == loader_config["micro_batch_size"]  # the loader's batch


def test_construction_refuses_what_cannot_work(loader_config, vocab_size, tmp_path):
    model = tiny_llama(vocab_size)
    with build_text_loader(loader_config) as loader:
        with pytest.raises(ValueError, match=r"args\.max_steps: got -1"):
            ZephonTrainer(model=model, args=training_args(tmp_path, max_steps=-1), train_loader=loader)
        with pytest.raises(TypeError, match="train_dataset="):
            ZephonTrainer(model=model, args=training_args(tmp_path), train_dataset=loader)
        with pytest.raises(ValueError, match="eval_loader: got the train_loader object"):
            ZephonTrainer(model=model, args=training_args(tmp_path), train_loader=loader, eval_loader=loader)
        with pytest.raises(ValueError, match=r"args\.label_smoothing_factor"):
            ZephonTrainer(model=model, args=training_args(tmp_path, label_smoothing_factor=0.1), train_loader=loader)
        with pytest.raises(TypeError, match="train_loader: got list"):
            ZephonTrainer(model=model, args=training_args(tmp_path), train_loader=[])
    user_args = training_args(tmp_path)
    with build_text_loader(loader_config) as loader:
        trainer = ZephonTrainer(model=model, args=user_args, train_loader=loader)
    assert trainer.args.ignore_data_skip and not user_args.ignore_data_skip  # the caller's object is untouched
    assert trainer.args.per_device_train_batch_size == 2 and user_args.per_device_train_batch_size == 8


def test_a_loader_built_for_another_data_parallel_layout_is_refused(loader_config, vocab_size, tmp_path):
    config = dict(loader_config, distributed={"aggregate_dir": str(tmp_path / "agg")})
    with build_text_loader(config, dp_rank=1, dp_world_size=2) as loader:
        with pytest.raises(ValueError, match=r"train_loader dp_world_size: got 2, expected 1"):
            ZephonTrainer(model=tiny_llama(vocab_size), args=training_args(tmp_path), train_loader=loader)


def test_batch_keys_the_model_does_not_take_are_refused(loader_config):
    with build_text_loader(loader_config) as loader:
        batches = TrainerBatches(
            loader, name="train_loader", chain=True, accepted=frozenset({"input_ids", "labels"}), model_name="Toy"
        )
        with pytest.raises(ValueError, match=r"train_loader batch keys: got \[.*'attention_mask'.*\].*Toy\.forward"):
            list(islice(batches, 1))
