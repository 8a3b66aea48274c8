"""ZephonLoader: the iterable a training loop (or an AutoModel recipe) holds.

The ``torchdata.nodes`` graph, one direction::

    ZephonSource ─► Mapper(collate) ─► ReadAhead(final map)? ─► Mapper(final map)? ─► PinMemory? ─► Loader

* ``ZephonSource``: state = ``pipeline.checkpoint()``, taken only in ``state_dict()``.
* ``collate``: ``SampleBatch.to_training`` + document ids (CPU tensors).
* final map: :func:`~zephon_loader.finalize.finalize_batch` then the optional
  recipe ``collate_wrapper``; run by :class:`~zephon_loader.readahead.ReadAhead`
  in a background thread when ``read_ahead > 0`` (exact on resume), else inline.
* ``PinMemory`` only when CUDA is available.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator, Mapping

import torch
from torchdata.nodes import BaseNode, Loader, Mapper, PinMemory
from torchdata.stateful_dataloader import StatefulDataLoader

from zephon_loader.finalize import FinalizeSettings, finalize_batch
from zephon_loader.readahead import ReadAhead
from zephon_loader.source import ZephonSource

#: Version tag of :meth:`ZephonLoader.state_dict`; bumped on incompatible changes.
STATE_FORMAT = "zephon_loader.state/1"


class FinalMap:
    """The final map stage as a picklable callable: finalize, then the recipe's wrapper.

    Args:
        settings: Fixed per loader.
        collate_wrapper: AutoModel-style ``wrapper(collate_fn) -> collate_fn``;
            it receives the finalized batch as its "examples".
    """

    def __init__(self, settings: FinalizeSettings, collate_wrapper: Callable | None = None) -> None:
        self.settings = settings
        self._wrapped = collate_wrapper(_identity) if collate_wrapper is not None else None

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        out = finalize_batch(batch, self.settings)
        return self._wrapped(out) if self._wrapped is not None else out


def _identity(batch: Any) -> Any:
    return batch


class ZephonLoader(StatefulDataLoader):
    """Iterate packed, finalized batches; save and restore the exact position.

    Built by :func:`~zephon_loader.builders.build_text_loader` (or the AutoModel
    config's ``build``). Drop-in for a ``StatefulDataLoader`` slot:

    * ``for batch in loader``: dicts of CPU tensors (pinned when CUDA is
      available) with AutoModel's names (SPEC §6). A second ``iter()`` starts
      a new pass from the beginning, unless ``load_state_dict`` came first.
    * ``state_dict()``: JSON- and pickle-safe dict. Taken after the training
      loop consumed ``k`` batches, a loader that ``load_state_dict``-s it yields
      batch ``k + 1`` next, read-ahead or not. In multi-rank runs it is a
      collective (Zephon aggregates lanes): every rank must call it.
    * ``load_state_dict(state)``: checked now (format, configuration
      fingerprint, Zephon's schema); applied at the next ``iter()``.
    * ``close()`` / ``with``: stops the read-ahead thread and Zephon's workers.

    Args:
        source: The Zephon source node (owned: closed with the loader).
        collate_fn: ``zephon SampleBatch -> TrainingBatch``.
        settings: Final-map settings (contract already validated).
        read_ahead: Batches prepared ahead in a background thread (0 = inline).
        collate_wrapper: Optional recipe wrapper applied to each finalized batch.
        fingerprint: JSON-able description of everything that fixes the batch
            stream; a state saved under another fingerprint is refused.
        pin_memory: Pin yielded tensors; ``None`` = when CUDA is available.
        on_close: Called once by :meth:`close` after the workers stopped
            (e.g. removes a tokenizer folder the builder saved).

    It subclasses torchdata's ``StatefulDataLoader`` only so that AutoModel
    0.7.0's recipe recognizes it as a dataloader and saves/loads its state per
    DP rank (``is_dataloader`` is an ``isinstance`` check); none of the
    ``DataLoader`` machinery is used (``len()`` raises ``TypeError``: the
    packed stream's length is not known in advance).
    """

    def __init__(
        self,
        source: ZephonSource,
        collate_fn: Callable[[Any], dict[str, Any]],
        settings: FinalizeSettings,
        *,
        read_ahead: int = 0,
        collate_wrapper: Callable | None = None,
        fingerprint: Mapping[str, Any] | None = None,
        pin_memory: bool | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"read_ahead: got {read_ahead!r}, expected an int >= 0")
        self.settings = settings
        self.fingerprint = dict(fingerprint or {})
        self._source = source
        self._collate_fn = collate_fn
        final_map = FinalMap(settings, collate_wrapper)
        node: BaseNode = Mapper(source, collate_fn)
        self._read_ahead: ReadAhead | None = None
        if read_ahead:
            self._read_ahead = ReadAhead(node, read_ahead, transform=final_map)
            node = self._read_ahead
        else:
            node = Mapper(node, final_map)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory:
            node = PinMemory(node)
        self._loader = Loader(node, restart_on_stop_iteration=False)
        self._on_close = on_close
        self._closed = False

    def __len__(self) -> int:
        raise TypeError("ZephonLoader has no len(): the number of packed batches is not known before iterating")

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._check_open()
        return iter(self._loader)

    @property
    def yielded_fields(self) -> tuple[str, ...]:
        """Names every yielded batch carries (see :mod:`zephon_loader.fields`)."""
        return self.settings.yielded_fields

    @property
    def pipeline(self) -> Any:
        """The underlying ``zephon.Pipeline``."""
        return self._source.pipeline

    def preview(self) -> dict[str, Any]:
        """The first batch of a fresh pass, as the final map sees it after adapt (and xdoc).

        Internal names (``document_ids``, ``attention_document_ids``,
        ``attention_eligibility`` when configured, ...) for inspection tools.
        It restarts the Zephon source: call it on a loader you are not
        iterating (the next ``iter()`` starts from the beginning anyway).

        Raises:
            RuntimeError: The stream is empty.
        """
        from zephon_loader import fields as F
        from zephon_loader.attention import adapt_model_inputs, join_subdocuments

        self._check_open()
        if self._read_ahead is not None:
            self._read_ahead.close()  # park the reader: the source is used from this thread now
        self._source.reset(None)
        try:
            raw = next(self._source)
        except StopIteration as error:
            raise RuntimeError("preview: the Zephon pipeline yielded no batch") from error
        batch = dict(self._collate_fn(raw))
        adapt_model_inputs(batch, batch.get(F.ATTENTION_ELIGIBILITY))
        if self.settings.xdoc:
            join_subdocuments(batch)
        self._source.reset(None)
        return batch

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The exact position of the training loop (see the class docstring)."""
        self._check_open()
        return {
            "format": STATE_FORMAT,
            "fingerprint": copy.deepcopy(self.fingerprint),
            "loader": self._loader.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output at the next ``iter()``.

        Raises:
            TypeError: Not a mapping.
            ValueError: Empty, another format, a different configuration
                (the differing keys are named), or a corrupt Zephon checkpoint.
                Never a silent fresh start.
        """
        self._check_open()
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict: got {type(state_dict).__name__}, expected the dict returned by ZephonLoader.state_dict()"
            )
        if not state_dict:
            raise ValueError(
                "state_dict: got an empty dict, expected the dict returned by ZephonLoader.state_dict(); "
                "to start from the beginning, do not call load_state_dict"
            )
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"state_dict.format: got {state_dict.get('format')!r}, expected {STATE_FORMAT!r}; "
                "this state was not saved by this version of ZephonLoader.state_dict()"
            )
        saved = state_dict.get("fingerprint")
        if saved != self.fingerprint:
            saved = saved if isinstance(saved, Mapping) else {}
            differing = sorted(
                key for key in set(saved) | set(self.fingerprint) if saved.get(key) != self.fingerprint.get(key)
            )
            details = "; ".join(
                f"{key}: saved {saved.get(key)!r}, now {self.fingerprint.get(key)!r}" for key in differing[:6]
            )
            raise ValueError(
                f"state_dict.fingerprint: the state was saved by a loader with a different configuration ({details}); "
                "resume with the configuration it was saved with"
            )
        loader_state = state_dict.get("loader")
        zephon_state = _find_source_state(loader_state)
        if zephon_state is None:
            raise ValueError(
                "state_dict.loader: no Zephon checkpoint found inside; expected the dict returned by "
                "ZephonLoader.state_dict() (the state is truncated or corrupt)"
            )
        try:
            self._source.validate_state(zephon_state)
        except Exception as error:  # Zephon raises several types for a bad schema
            raise ValueError(f"state_dict: the Zephon checkpoint inside is corrupt or incompatible: {error}") from error
        self._loader.load_state_dict(copy.deepcopy(dict(loader_state)))

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the read-ahead thread and Zephon's workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._read_ahead is not None:
            self._read_ahead.close()
        self._source.close()
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> "ZephonLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ZephonLoader is closed; build a new loader")


def _find_source_state(state: Any) -> Mapping[str, Any] | None:
    """The Zephon checkpoint nested in a torchdata ``Loader`` state (through Mapper/ReadAhead levels)."""
    while isinstance(state, Mapping):
        if ZephonSource.is_state(state):
            return state
        for key in ("root", "it_state", ReadAhead.SOURCE_KEY):
            if key in state:
                state = state[key]
                break
        else:
            return None
    return None
