"""Train with the Hugging Face ``transformers.Trainer`` on :class:`~zephon_loader.loader.ZephonLoader` s.

Optional extra ``trainer`` (``transformers`` + ``accelerate``); imported only
when this module is (``from zephon_loader.integrations.hf import ZephonTrainer``).

The data flow is the loader's own; the Trainer only consumes it::

    ZephonLoader ─► TrainerBatches (passes chained; + shift_labels for HF causal LMs) ─► Trainer step
         ▲                                                                                 │ checkpoint-N/
         └── load_state_dict(zephon_loader_state_rank{r}.json) ◄── resume ◄─── state_dict() per rank

What :class:`ZephonTrainer` changes against a stock ``Trainer``, and why:

* **No re-wrapping.** The Trainer builds a ``DataLoader`` over its dataset and
  passes it through ``accelerator.prepare``, which shards or dispatches it per
  process. A ZephonLoader already gives each data-parallel rank its own Zephon
  lane and is not a ``DataLoader`` over a dataset (``prepare`` and accelerate's
  ``skip_first_batches`` fail on it with ``AttributeError: ... 'dataset'``), so
  ``get_train_dataloader`` / ``get_eval_dataloader`` / ``get_test_dataloader``
  hand the loader's batches to the Trainer as they are: no collator, no
  ``remove_unused_columns``, no sharding.
* **Exact resume.** Every checkpoint folder gets
  ``zephon_loader_state_rank{r}.json`` per process (``loader.state_dict()``, a
  collective in multi-rank runs, taken at the optimizer step the Trainer
  checkpoints at, so with gradient accumulation it covers whole accumulation
  windows). ``train(resume_from_checkpoint=...)`` loads it and the Trainer does
  not fast-forward by re-reading batches (``ignore_data_skip`` is forced on the
  Trainer's copy of the arguments; model, optimizer, scheduler and RNG states
  are restored as usual, and ``state.epoch``, the fraction of ``max_steps``
  done, continues instead of restarting at 0). A checkpoint without the file,
  or with one of another step, is refused.
* **Steps, not epochs.** The loader has no ``len()``: ``max_steps`` is required.
  Passes are chained: when a pass ends the next ``iter()`` starts the loader's
  next epoch (its own order from ``(seed, epoch)``; the epoch is in its
  state), so accumulation windows run across pass boundaries and the Trainer's
  epoch counter (always 0 with ``max_steps`` on an unsized loader, also after a
  resume) never reaches the loader. The training batches are read one ahead
  inside a pass, so the step that trains a pass's last batch knows it: the
  ``"epoch"`` save, evaluation and logging strategies act there, and a
  checkpoint there holds an ended pass. A fresh ``train()`` starts at epoch 0; each
  evaluation reads epoch 0 of its loader, so every evaluation sees the same
  batches.
* **Labels.** The loader's ``labels`` are next-token targets (already shifted,
  ``-100`` = ignored). A Hugging Face causal-LM loss (``ForCausalLMLoss``)
  shifts ``labels`` again, which would train position ``t`` on token
  ``t + 2`` and drop the last target of every row. The ``hf`` contract yields
  the same tensor as ``shift_labels`` too, which that loss takes as given (and
  the Trainer's token count for ``num_items_in_batch`` reads); with another
  contract (``block_causal`` for an SDPA model, ``flash_varlen`` for HF flash
  kernels) the trainer adds it for such models. ``labels`` stays, so the model
  still computes its loss and ``compute_metrics`` receives next-token targets.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import re
from typing import Any, Iterator, Mapping

try:
    import accelerate  # noqa: F401  (transformers' Trainer needs it; checked here so the message names the extra)
    from transformers import Trainer, TrainerCallback
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"zephon_loader.integrations.hf needs transformers and accelerate ({error}); install them with "
        "pip install 'zephon-loader[trainer]'"
    ) from error

from zephon_loader import fields as F
from zephon_loader.errors import field_error
from zephon_loader.integrations.accelerate import checkpointed
from zephon_loader.loader import ZephonLoader
from zephon_loader.state import write_json_atomically

__all__ = ["STATE_FILE", "STATE_FORMAT", "TrainerBatches", "ZephonTrainer", "read_loader_state"]

logger = logging.getLogger(__name__)

#: Per-process loader state inside a Trainer checkpoint folder (``rank`` = ``args.process_index``).
STATE_FILE = "zephon_loader_state_rank{rank}.json"
#: Version tag of the file's JSON document.
STATE_FORMAT = "zephon_loader.hf_trainer_state/1"
#: Trainer checkpoint file holding the step (written by the Trainer itself).
_TRAINER_STATE_NAME = "trainer_state.json"


_END = object()  # TrainerBatches: no batch ahead, the pass ended


class TrainerBatches:
    """The loader's batches as the Trainer's "dataloader": iterable, unsized, never wrapped.

    Yields the loader's dicts unchanged (a new dict only when ``shift_labels``
    is added because the batch lacks it: the same ``labels`` tensor under a
    second name; no tensor is copied or modified). It has no ``len()`` and no
    ``set_epoch``: the Trainer's epoch number is not the loader's (see the
    module docstring).

    Args:
        loader: The loader to read.
        name: How errors name it (``"train_loader"``, ``"eval_loader"``, ...).
        chain: Start the next pass when one ends (training): the Trainer sees
            one endless stream and stops at ``max_steps``. ``False``: one pass
            (evaluation).
        epoch: ``set_epoch(epoch)`` before each pass this object starts from
            ``iter()`` when the loader has ``set_epoch`` (evaluation: 0);
            ``None``: leave the loader's epoch alone.
        shift_labels: Also yield ``labels`` as ``shift_labels`` when the batch
            does not carry it (the ``hf`` contract does).
        accepted: The model's ``forward`` argument names when it takes no
            ``**kwargs``; a batch with another key is refused. ``None``: any key.
        model_name: For that error.

    Raises (while iterating):
        ValueError: A batch key the model does not take.
        RuntimeError: ``chain`` and a pass that follows an exhausted one
            yielded no batch (the stream is empty: it would loop forever).
    """

    def __init__(
        self,
        loader: ZephonLoader,
        *,
        name: str,
        chain: bool,
        epoch: int | None = None,
        shift_labels: bool = False,
        accepted: frozenset[str] | None = None,
        model_name: str = "the model",
    ) -> None:
        self.loader = loader
        self.name = name
        self.chain = chain
        self.epoch = epoch
        self.shift_labels = shift_labels
        self.accepted = accepted
        self.model_name = model_name
        self.pass_ends = 0  # training passes whose last batch was handed out (chain=True)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        set_epoch = getattr(self.loader, "set_epoch", None)
        if self.epoch is not None and set_epoch is not None:
            set_epoch(self.epoch)
        if not self.chain:
            for batch in self.loader:
                yield self._for_model(batch)
            return
        follows_exhausted = False
        while True:
            # One batch ahead inside a pass: the batch handed out is known to be the pass's last one when it is
            # handed out (pass_ends counts it: "epoch" save/eval strategies fire at that step), and the loader is
            # told what the step took (note_consumed), so a state saved then describes exactly the trained batches
            # (an ended pass when the last one was trained). The next pass starts only when its first batch is asked.
            batches = iter(self.loader)  # a new pass (the loader's next epoch after an exhausted one)
            ahead = next(batches, _END)
            if ahead is _END and follows_exhausted:
                epoch = getattr(self.loader, "epoch", None)
                raise RuntimeError(
                    f"{self.name}: a new pass{'' if epoch is None else f' (epoch {epoch})'} yielded no batch right "
                    "after the previous one ended, so the stream is empty and max_steps can never be reached; "
                    "check the sources (loader.stats() lists what was dropped and why)"
                )
            while ahead is not _END:
                batch, ahead = ahead, next(batches, _END)
                self.loader.note_consumed()
                if ahead is _END:
                    self.pass_ends += 1
                yield self._for_model(batch)
            follows_exhausted = True

    def _for_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.accepted is not None:
            unknown = sorted(set(batch) - self.accepted)
            if unknown:
                raise ValueError(field_error(
                    f"{self.name} batch keys", unknown, f"arguments of {self.model_name}.forward "
                    f"({sorted(self.accepted)})",
                    "Build the loader with the contract this model reads (stock Hugging Face models: "
                    "contract {attn_implementation: hf}), or pass collate_wrapper= to build_text_loader to map "
                    "each batch onto the model's arguments.",
                ))
        if self.shift_labels and F.LABELS in batch and F.SHIFT_LABELS not in batch:
            return {**batch, F.SHIFT_LABELS: batch[F.LABELS]}
        return batch


class ZephonTrainer(Trainer):
    """``transformers.Trainer`` fed by :class:`~zephon_loader.loader.ZephonLoader` s, resuming exactly.

    Use it like ``Trainer`` with ``train_loader=`` instead of ``train_dataset=``
    (and ``eval_loader=`` instead of ``eval_dataset=``); every other argument
    is the Trainer's. See the module docstring for what differs and why.

    Args:
        model: As for ``Trainer``.
        args: As for ``Trainer``; ``args.max_steps`` must be > 0 when
            training (the loader has no length).
        train_loader: This process's training loader (built with this rank's
            ``dp_rank``/``dp_world_size``). The trainer reads and checkpoints
            it; it does not close it.
        eval_loader: A loader, or a mapping of names to loaders
            (``eval_<name>_loss`` metrics, as ``Trainer`` does for a dict of
            datasets); each evaluation reads one whole pass of epoch 0.
        **kwargs: Other ``Trainer`` arguments (``callbacks``,
            ``processing_class``, ``compute_metrics``, ...). ``train_dataset``,
            ``eval_dataset`` and ``data_collator`` are refused: the loader
            batches and collates.

    The Trainer works on a copy of ``args`` (the caller's object is not
    modified) with ``ignore_data_skip=True`` and the per-device batch sizes
    set to the loaders' ``micro_batch_size`` (they only feed the Trainer's
    sample counts and throughput metrics; the loader fixes the batch).
    ``TrainingArguments.dataloader_*`` settings do not apply (the loader has
    its own ``read_ahead`` and ``runtime``).

    Raises:
        TypeError: A loader that is not a ``ZephonLoader``, or a refused argument.
        ValueError: ``max_steps`` not set, ``auto_find_batch_size``, label
            smoothing with a causal-LM loss (the Trainer's smoother shifts the
            labels again), ``batch_eval_metrics`` (the loader cannot tell the
            Trainer which batch is the last), the same loader for training and
            evaluation, or a loader built for another data-parallel layout than
            the Trainer's processes.
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *,
        train_loader: ZephonLoader | None = None,
        eval_loader: ZephonLoader | Mapping[str, ZephonLoader] | None = None,
        **kwargs: Any,
    ) -> None:
        for refused in ("train_dataset", "eval_dataset", "data_collator"):
            if refused in kwargs:
                raise TypeError(
                    f"ZephonTrainer: got {refused}=, expected train_loader= / eval_loader= (ZephonLoaders); the loader "
                    "packs and collates its batches, and the Trainer must not batch them again"
                )
        self.train_loader = _checked_loader("train_loader", train_loader) if train_loader is not None else None
        self.eval_loader = _checked_eval_loaders(eval_loader)
        if self.train_loader is not None and any(e is self.train_loader for e in _eval_list(self.eval_loader)):
            raise ValueError(
                "eval_loader: got the train_loader object, expected a loader of its own; an evaluation pass restarts "
                "the loader it reads, which would make the training iterator stale. Build a second loader"
            )
        if args is not None:
            args = _trainer_args(args, self.train_loader, self.eval_loader)
        self._resume_state: dict[str, Any] | None = None  # set by train(resume_from_checkpoint=...)
        super().__init__(model=model, args=args, eval_dataset=self.eval_loader, **kwargs)
        if args is None:  # Trainer made its defaults (max_steps=-1): refused below when there is a train_loader
            self.args = _trainer_args(self.args, self.train_loader, self.eval_loader)
        unwrapped = self.accelerator.unwrap_model(self.model) if self.model is not None else None
        self._shift_labels = _loss_shifts_labels(unwrapped)
        if self._shift_labels and self.args.label_smoothing_factor != 0:
            raise ValueError(field_error(
                "args.label_smoothing_factor", self.args.label_smoothing_factor, "0 with a causal-LM model",
                "The Trainer's label smoother shifts labels again, and the loader's labels are already next-token "
                "targets; smooth inside a compute_loss_func (it receives the loader's labels, unshifted) instead.",
            ))
        if self.args.batch_eval_metrics and self.eval_loader is not None:
            raise ValueError(field_error(
                "args.batch_eval_metrics", True, "False with an eval_loader",
                "The Trainer learns that a batch is the last one of an evaluation only from accelerate's prepared "
                "DataLoader, which a ZephonLoader is not; compute metrics over the whole pass (the default).",
            ))
        self.add_callback(_StepEpoch())
        self.add_callback(_PassEnds())
        self._accepted = _accepted_keys(unwrapped)
        self._model_name = type(unwrapped).__name__ if unwrapped is not None else "the model"
        if self.train_loader is not None:
            self._check_data_parallel(self.train_loader, "train_loader")
            if (self.train_loader.dp_world_size > 1 and self.train_loader.setting("passes", 1) is not None
                    and not self.train_loader._even_passes):
                # Lanes end a pass at different steps: a rank that chains into its next epoch alone is out of step.
                logger.warning(
                    "ZephonTrainer: train_loader is finite (passes=%s) with %d data-parallel ranks; their lanes end a "
                    "pass at different steps, so a run that crosses a pass boundary goes out of step. Set passes: "
                    "null (an endless stream; the Trainer stops at max_steps), or leave distributed.even_passes on "
                    "(every rank then ends its pass at the same batch).",
                    self.train_loader.setting("passes", 1), self.train_loader.dp_world_size)
        for name, loader in _eval_items(self.eval_loader):
            self._check_data_parallel(loader, name)
        # This trainer checkpoints the training loader; evaluation reads epoch 0 from its start every time.
        checkpointed.update(([self.train_loader] if self.train_loader is not None else []) + _eval_list(self.eval_loader))

    # -- data -----------------------------------------------------------------------------
    def get_train_dataloader(self) -> TrainerBatches:  # type: ignore[override]
        """The train loader's batches, positioned at the checkpoint being resumed (or at epoch 0's start)."""
        if self.train_loader is None:
            raise ValueError("ZephonTrainer: training needs train_loader= (a ZephonLoader)")
        if self._resume_state is not None:
            self.train_loader.load_state_dict(self._resume_state)
        elif getattr(self.train_loader, "set_epoch", None) is not None:
            self.train_loader.set_epoch(0)  # a fresh train() reads the stream a fresh process would
        return self._batches(self.train_loader, "train_loader", chain=True, epoch=None)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> TrainerBatches:  # type: ignore[override]
        """One pass (epoch 0) of the eval loader: ``eval_dataset`` is a name of ``eval_loader``, a loader, or None."""
        if eval_dataset is None:
            if self.eval_loader is None:
                raise ValueError("ZephonTrainer: evaluation needs eval_loader= (a ZephonLoader or a dict of them)")
            if isinstance(self.eval_loader, Mapping):  # Trainer.evaluate() passes the names one by one
                raise ValueError(
                    f"ZephonTrainer: eval_loader holds several loaders ({sorted(self.eval_loader)}); evaluate() "
                    "goes through them by name, get_eval_dataloader needs one of the names"
                )
            return self._batches(self.eval_loader, "eval_loader", chain=False, epoch=0)
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_loader, Mapping) or eval_dataset not in self.eval_loader:
                names = sorted(self.eval_loader) if isinstance(self.eval_loader, Mapping) else []
                raise ValueError(field_error("eval_dataset", eval_dataset, f"one of the eval_loader names {names}",
                                           "Pass eval_loader={name: loader, ...} to name loaders."))
            return self._batches(self.eval_loader[eval_dataset], f"eval_loader[{eval_dataset!r}]", chain=False, epoch=0)
        return self._batches(_checked_loader("eval_dataset", eval_dataset), "eval_dataset", chain=False, epoch=0)

    def get_test_dataloader(self, test_dataset: Any) -> TrainerBatches:  # type: ignore[override]
        """One pass (epoch 0) of ``test_dataset``, a ZephonLoader (``trainer.predict(loader)``)."""
        return self._batches(_checked_loader("test_dataset", test_dataset), "test_dataset", chain=False, epoch=0)

    def _batches(self, loader: ZephonLoader, name: str, *, chain: bool, epoch: int | None) -> TrainerBatches:
        return TrainerBatches(
            loader, name=name, chain=chain, epoch=epoch, shift_labels=self._shift_labels,
            accepted=self._accepted, model_name=self._model_name,
        )

    # -- checkpoints ----------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with ``resume_from_checkpoint`` the loader continues from that checkpoint's state.

        Raises:
            ValueError: ``resume_from_checkpoint=True`` without a checkpoint in
                ``args.output_dir``, or a checkpoint without (or with a
                mismatched) ``zephon_loader_state_rank{r}.json``.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(field_error(
                    "resume_from_checkpoint", True, f"a checkpoint-N folder in args.output_dir "
                    f"({self.args.output_dir})",
                    "Pass the checkpoint folder, or train without resume_from_checkpoint.",
                ))
        elif resume_from_checkpoint is False:
            resume_from_checkpoint = None
        # Read (and refuse) before the Trainer loads anything; loaded into the loader by get_train_dataloader.
        self._resume_state = (
            None if resume_from_checkpoint is None
            else read_loader_state(str(resume_from_checkpoint), self.args.process_index,
                                   every_rank=self.train_loader is not None and self.train_loader.state_scope == "rank")
        )
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._resume_state = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write each process's loader state into the checkpoint folder, then the Trainer's own files.

        Written first, so a folder with ``trainer_state.json`` always has it.
        ``state_dict()`` is a collective in multi-rank runs: every process
        checkpoints at the same step, so every process calls it.
        """
        if self.train_loader is not None:
            run_dir = self._get_output_dir(trial=trial)
            folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            document = {
                "format": STATE_FORMAT,
                "global_step": self.state.global_step,
                "process_index": self.args.process_index,
                "world_size": self.args.world_size,
                "loader": self.train_loader.state_dict(),
            }
            write_json_atomically(os.path.join(folder, STATE_FILE.format(rank=self.args.process_index)), document)
        super()._save_checkpoint(model, trial)

    # -- checks ---------------------------------------------------------------------------
    def _check_data_parallel(self, loader: ZephonLoader, name: str) -> None:
        """Refuse a loader whose Zephon DP layout is not the Trainer's (duplicated or missing data otherwise)."""
        replicas = self.get_tp_size() * self.get_cp_size() * self.get_sp_size()  # peers that read the same batch
        expected_size = max(self.args.world_size // replicas, 1)
        rank, size = _loader_data_parallel(loader)
        if size != expected_size:
            raise ValueError(field_error(
                f"{name} dp_world_size", size, f"{expected_size} (the Trainer's data-parallel processes)",
                f"Build each process's loader with dp_world_size={expected_size} and its own dp_rank; with "
                f"dp_world_size={size} the processes would read the wrong share of the stream.",
            ))
        if replicas == 1 and rank != self.args.process_index:
            raise ValueError(field_error(
                f"{name} dp_rank", rank, f"{self.args.process_index} (this process's args.process_index)",
                "Build each process's loader with dp_rank=args.process_index.",
            ))


def read_loader_state(checkpoint: str, process_index: int,
                      every_rank: bool = False) -> dict[str, Any] | list[dict[str, Any]]:
    """The loader state :class:`ZephonTrainer` saved in a Trainer checkpoint folder, for ``process_index``.

    A process reads its own rank's file; a process without one (the run
    resumes at more processes than saved it) reads rank 0's: a state of
    ``distributed.state_scope: job`` holds every lane, so any of them
    resumes any rank. ``every_rank`` (``state_scope: rank``): every rank's
    file, as a list (``ZephonLoader.load_state_dict`` keeps the lanes this
    rank owns, at any number of processes).

    Raises:
        ValueError: No such file, not this module's format, or a step that is
            not the checkpoint's (``trainer_state.json``).
    """
    if every_rank:
        ranks = sorted(int(match.group(1)) for name in os.listdir(checkpoint)
                       if (match := re.fullmatch(STATE_FILE.format(rank=r"(\d+)").replace(".", r"\."), name)))
        if ranks:
            return [read_loader_state(checkpoint, rank) for rank in ranks]
    path = os.path.join(checkpoint, STATE_FILE.format(rank=process_index))
    if not os.path.isfile(path):
        path = os.path.join(checkpoint, STATE_FILE.format(rank=0))
    if not os.path.isfile(path):
        raise ValueError(field_error(
            "resume_from_checkpoint", checkpoint, f"a folder holding {STATE_FILE.format(rank=process_index)} "
            f"(or rank 0's)", "It was not saved by ZephonTrainer, so the loader's position is unknown; resume from a "
            "checkpoint ZephonTrainer wrote, or train without resume_from_checkpoint to start the stream over.",
        ))
    with open(path) as handle:
        try:
            document = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error}); the file is truncated or corrupt") from error
    if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
        seen = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(field_error(f"{path} format", seen, repr(STATE_FORMAT),
                                     "Resume with the zephon_loader version that wrote this checkpoint."))
    trainer_state = os.path.join(checkpoint, _TRAINER_STATE_NAME)
    if os.path.isfile(trainer_state):
        step = TrainerState.load_from_json(trainer_state).global_step
        if document.get("global_step") != step:
            raise ValueError(field_error(
                f"{path} global_step", document.get("global_step"), f"{step} (trainer_state.json of this checkpoint)",
                "The loader state belongs to another checkpoint; do not copy state files between checkpoint folders.",
            ))
    loader_state = document.get("loader")
    if not isinstance(loader_state, dict):
        raise ValueError(f"{path} loader: got {type(loader_state).__name__}, expected a dict "
                         "(ZephonLoader.state_dict()). The file is truncated or corrupt.")
    return loader_state


# -- helpers ------------------------------------------------------------------------------
class _PassEnds(TrainerCallback):
    """The ``"epoch"`` logging, evaluation and save strategies act at the optimizer step that trained a training
    pass's last batch: the Trainer never sees an epoch end itself, since the passes are chained into one stream.

    A checkpoint saved there holds an ended pass: its resume starts the next epoch.
    """

    def __init__(self) -> None:
        self._seen = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._seen = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        batches = kwargs.get("train_dataloader")
        ended = getattr(batches, "pass_ends", 0)
        if not isinstance(batches, TrainerBatches) or ended == self._seen:
            return
        self._seen = ended
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= state.epoch:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True


class _StepEpoch(TrainerCallback):
    """Keep ``state.epoch`` (logs, ``trainer_state.json``) equal to the uninterrupted run's after a resume.

    With ``max_steps`` on an unsized loader the Trainer's epoch is the fraction
    of ``max_steps`` done, which it counts from the micro-batches of the
    current ``train()`` call: a resumed run would restart it at 0.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.max_steps > 0:
            state.epoch = state.global_step / state.max_steps


def _checked_loader(name: str, loader: Any) -> ZephonLoader:
    if not isinstance(loader, ZephonLoader):
        raise TypeError(f"{name}: got {type(loader).__name__}, expected a ZephonLoader. "
                        "Build it with zephon_loader.build_text_loader(...).")
    return loader


def _checked_eval_loaders(eval_loader: Any) -> ZephonLoader | dict[str, ZephonLoader] | None:
    if eval_loader is None or not isinstance(eval_loader, Mapping):
        return None if eval_loader is None else _checked_loader("eval_loader", eval_loader)
    return {str(name): _checked_loader(f"eval_loader[{name!r}]", loader) for name, loader in eval_loader.items()}


def _eval_items(eval_loader: ZephonLoader | Mapping[str, ZephonLoader] | None) -> list[tuple[str, ZephonLoader]]:
    if eval_loader is None:
        return []
    if isinstance(eval_loader, Mapping):
        return [(f"eval_loader[{name!r}]", loader) for name, loader in eval_loader.items()]
    return [("eval_loader", eval_loader)]


def _eval_list(eval_loader: ZephonLoader | Mapping[str, ZephonLoader] | None) -> list[ZephonLoader]:
    return [loader for _, loader in _eval_items(eval_loader)]


def _micro_batch_size(loader: ZephonLoader) -> int | None:
    value = loader.setting("micro_batch_size")  # what the builder fixed (fingerprint.py records it)
    return value if isinstance(value, int) else None


def _trainer_args(args: Any, train_loader: ZephonLoader | None, eval_loader: Any) -> Any:
    """The Trainer's copy of ``args``: data skipping off, batch sizes the loaders'; refuses what cannot work."""
    if train_loader is not None and args.max_steps <= 0:
        raise ValueError(field_error(
            "args.max_steps", args.max_steps, "a positive number of optimizer steps",
            "A ZephonLoader has no len(), so the Trainer cannot derive steps from num_train_epochs; set "
            "TrainingArguments(max_steps=N). Passes over the data follow one another (the loader's epochs).",
        ))
    if args.auto_find_batch_size:
        raise ValueError(field_error(
            "args.auto_find_batch_size", True, "False",
            "The loader fixes the batch (micro_batch_size in its configuration); the Trainer cannot shrink it.",
        ))
    args = copy.copy(args)
    args.ignore_data_skip = True  # the loader state is the data position; never re-read batches to skip them
    train_batch = _micro_batch_size(train_loader) if train_loader is not None else None
    if train_batch is not None and args.per_device_train_batch_size != train_batch:
        logger.info("ZephonTrainer: per_device_train_batch_size %s -> %s (the train loader's micro_batch_size)",
                    args.per_device_train_batch_size, train_batch)
        args.per_device_train_batch_size = train_batch
    eval_batches = {_micro_batch_size(loader) for loader in _eval_list(eval_loader)}
    if len(eval_batches) == 1 and None not in eval_batches:
        args.per_device_eval_batch_size = eval_batches.pop()
    return args


def _loss_shifts_labels(model: Any) -> bool:
    """Whether the model's loss shifts ``labels`` itself (Hugging Face decoder-only causal LM)."""
    if model is None or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss


def _accepted_keys(model: Any) -> frozenset[str] | None:
    """``model.forward``'s argument names, or None when it takes ``**kwargs`` (any key reaches it)."""
    if model is None:
        return None
    parameters = inspect.signature(model.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters)


def _loader_data_parallel(loader: ZephonLoader) -> tuple[int, int]:
    """(dp_rank, dp_world_size) the loader was built for."""
    return loader.dp_rank, loader.dp_world_size

