"""The loader's saved position: :class:`LoaderState`, its format tag and every check a loaded state passes.

:meth:`ZephonLoader.state_dict <zephon_loader.loader.ZephonLoader.state_dict>`
returns ``LoaderState.to_dict()`` and
:meth:`~zephon_loader.loader.ZephonLoader.load_state_dict` keeps
``LoaderState.from_dict(...)`` until the next ``iter()``. The dict is JSON- and
pickle-safe (plain dicts, lists, ints, bools, strings)::

    {"format": "zephon_loader.state/4",
     "fingerprint": {...},                 # what fixes the stream (the builders)
     "epoch": int,                         # the epoch of the checkpoint (absent: 0)
     "pass_ended": bool,                   # the epoch's pass was read to its end (absent: False)
     "zephon_checkpoint": {...} | None,    # Zephon's checkpoint of every lane at a point before
                                           # the read-ahead; None: the start of the epoch
     "skip": {"<lane>": int},              # batches of each lane after that checkpoint that were
                                           # already delivered (a resume drops them)
     "carried": [{"epoch", "zephon_checkpoint", "skip"}, ...],  # earlier epochs' pipelines this pass
                                           # still reads first (ranks ended a pass early); usually []
     "carry": [...],                       # the same, as the pass began (pass_ended: as the next begins)
     "stats": {...} | None,                # LoaderStats.state_dict(), every lane; None without accounting
     "phase": {"index": k, "batches": {"<lane>": int}},  # a mixture schedule's phase of the checkpoint and
                                           # each lane's batches in it (absent without a schedule)
     "lanes": [int, ...],                  # the lanes it holds (absent: every lane)
     "checksum": "sha256:<64 hex>"}        # over the canonical JSON of every other key (content_checksum)

With ``distributed.state_scope: job`` (the default) the state holds every
lane and nothing tied to a rank: it is the same on every rank of a job. With
``rank`` it holds the lanes of one rank (``lanes``): every lane-keyed part
(Zephon's checkpoints, ``skip``, the counts) is cut to them, so its size is
O(lanes / ranks); :func:`merge_states` joins several such states (an elastic
resume), :meth:`LoaderState.for_lanes` cuts one.

What a check needs from the loader (its fingerprint, its lane count, its
source's checkpoint check, its accounting) is passed to
:meth:`LoaderState.from_dict`; this module knows nothing of the loader.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from zephon_loader.fingerprint import describe_difference
from zephon_loader.nodes.source import checked_epoch, checked_link, checked_skip
from zephon_loader.stats import LoaderStats
from zephon_loader.zephon_compat import checkpoint_lanes, lanes_of_checkpoint, merge_lane_checkpoints

__all__ = ["RETIRED_FORMATS", "STATE_FORMAT", "LoaderState", "content_checksum", "lane_ranges", "merge_states",
           "read_state_file", "save_state_file", "state_paths", "write_atomically", "write_json_atomically"]

#: Version tag of a saved state (its ``format``); bumped on incompatible changes.
STATE_FORMAT = "zephon_loader.state/4"
#: Earlier formats, with why they cannot be resumed.
RETIRED_FORMATS = {
    "zephon_loader.state/3": (
        "it was saved by an earlier zephon_loader whose state carried no checksum and whose fingerprint read only "
        "the first and last 64 KiB of each shard"
    ),
    "zephon_loader.state/2": (
        "it was saved by an earlier zephon_loader whose state carried every rank's read-ahead batches and "
        "per-rank counts; this version cuts the state before the read-ahead and counts per lane"
    ),
    "zephon_loader.state/1": (
        "it was saved by an earlier zephon_loader whose state nested torchdata's node states, so its layout "
        "depended on read_ahead and it did not carry the lane of read-ahead batches"
    ),
}


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """One exact position of a :class:`~zephon_loader.loader.ZephonLoader` stream.

    Field order is the key order of :meth:`to_dict`.

    Attributes:
        format: :data:`STATE_FORMAT`.
        fingerprint: JSON-able description of everything that fixes the stream;
            a state is only loaded by a loader with the same one.
        epoch: The epoch of ``zephon_checkpoint`` (``>= 0``).
        pass_ended: That epoch's pass was read to its end: the state resumes at
            the start of the next epoch.
        zephon_checkpoint: Zephon's merged checkpoint of every lane (the same
            on every rank) at the position before the first batch the training
            loop has not taken; ``None``: the start of the epoch.
        skip: Lane (as a string) -> batches of that lane after
            ``zephon_checkpoint`` the training loop has already taken: a
            resume drops them (the checkpoint is an anchor the read-ahead took
            at most a few batches earlier, not a copy of the batches).
        carried: Earlier epochs' pipelines still read in this pass before the
            current one, as ``{"epoch", "zephon_checkpoint", "skip"}``: batches
            left on some ranks when every rank ended a pass at the shortest
            rank's count (:mod:`zephon_loader.nodes.agreement`).
        carry: What the pass began with (a restart of it reads that again); in
            a state whose pass ended, what the next pass reads first.
        stats: :meth:`LoaderStats.state_dict` of the delivered counts, every
            lane's, or ``None`` for a loader built without accounting.
        phase: A mixture schedule's phase and each lane's batches in it (``None`` without a schedule).
        lanes: The lanes the state holds, sorted; ``None``: every lane (``distributed.state_scope: job``).

    :meth:`to_dict` adds ``checksum`` (:func:`content_checksum` of the other
    keys); :meth:`from_dict` refuses a state whose content no longer matches it.
    """

    format: str = STATE_FORMAT
    fingerprint: dict[str, Any]
    epoch: int
    pass_ended: bool
    zephon_checkpoint: dict[str, Any] | None
    skip: dict[str, int]
    carried: list[dict[str, Any]]
    carry: list[dict[str, Any]]
    stats: dict[str, Any] | None
    phase: dict[str, Any] | None = None
    lanes: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The state as a plain dict, one key per field in field order (``phase`` only with a schedule, ``lanes``
        only when it holds some lanes), then ``checksum``; the values are this state's own (not copied)."""
        state = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                 if not (field.name in ("phase", "lanes") and getattr(self, field.name) is None)}
        state["checksum"] = content_checksum(state)
        return state

    def held_lanes(self, canonical_replicas: int) -> set[int]:
        """The lanes this state holds (``lanes``, or every one of ``canonical_replicas``)."""
        return set(self.lanes) if self.lanes is not None else set(range(canonical_replicas))

    def for_lanes(self, lanes: Any) -> "LoaderState":
        """This state cut to ``lanes`` (a subset of what it holds): Zephon's checkpoints (the current one and each
        carried link's), ``skip``, the per-lane counts and the phase's batches; the job-wide fields as they are.

        Raises:
            ValueError: A lane of ``lanes`` the state does not hold.
        """
        wanted = sorted({int(lane) for lane in lanes})
        if self.lanes is not None and not set(wanted) <= set(self.lanes):
            raise ValueError(f"state_dict.lanes: the state holds lanes {lane_ranges(self.lanes)}, expected "
                             f"{lane_ranges(set(wanted) - set(self.lanes))} too")
        if self.lanes == wanted:
            return self
        keep = set(wanted)

        def cut_skip(skip: Mapping[str, int]) -> dict[str, int]:
            return {lane: n for lane, n in skip.items() if int(lane) in keep}

        def cut_checkpoint(checkpoint: Mapping[str, Any] | None) -> dict[str, Any] | None:
            return None if checkpoint is None else lanes_of_checkpoint(checkpoint, keep)

        def cut_links(links: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{**link, "zephon_checkpoint": cut_checkpoint(link["zephon_checkpoint"]),
                     "skip": cut_skip(link.get("skip") or {})} for link in links]

        stats = self.stats
        if stats is not None:
            stats = {**stats, "lanes": {lane: entry for lane, entry in stats["lanes"].items() if int(lane) in keep}}
        phase = self.phase
        if phase is not None:
            phase = {"index": phase["index"], "batches": cut_skip(phase["batches"])}
        return dataclasses.replace(self, zephon_checkpoint=cut_checkpoint(self.zephon_checkpoint),
                                   skip=cut_skip(self.skip), carried=cut_links(self.carried),
                                   carry=cut_links(self.carry), stats=stats, phase=phase, lanes=wanted)

    @classmethod
    def from_dict(
        cls,
        state: Any,
        *,
        fingerprint: Mapping[str, Any],
        canonical_replicas: int,
        check_checkpoint: Callable[[Mapping[str, Any]], None],
        stats: LoaderStats | None,
    ) -> "LoaderState":
        """Check a saved state against the loader that is to resume it; a deep copy of it.

        Checked in this order: a non-empty mapping; ``format`` (a retired one
        says why it cannot be resumed); ``fingerprint`` (the differing keys are
        named, at most 6); ``checksum`` (the content is what ``to_dict`` made:
        not edited, truncated or damaged since); ``zephon_checkpoint`` (a mapping that Zephon's
        schema accepts, with ``canonical_replicas`` lanes, or ``None``);
        every key present (``epoch`` and ``pass_ended`` may be absent: 0, False)
        and no other; ``epoch``; ``pass_ended``; ``skip``
        (lanes in range, counts >= 0); ``carried``/``carry`` (each link's lanes in
        range, its epoch at most the state's, no link twice); ``stats``. The
        checksum is not a signature (anyone can recompute it): these checks
        hold the content to what ``to_dict`` can make; a ``skip`` larger than
        its lane holds after the checkpoint is refused when that lane ends
        (:class:`~zephon_loader.nodes.source.ZephonSource`).

        Args:
            state: What :meth:`to_dict` returned, possibly after a JSON or
                pickle round trip.
            fingerprint: The resuming loader's fingerprint.
            canonical_replicas: The resuming loader's Zephon lane count.
            check_checkpoint: Raises for a Zephon checkpoint its schema refuses
                (:meth:`ZephonSource.validate_state
                <zephon_loader.nodes.source.ZephonSource.validate_state>`).
            stats: The resuming loader's accounting, or ``None`` (then the
                saved ``stats`` is ignored and the result holds ``None``).

        Raises:
            TypeError: Not a mapping.
            ValueError: Empty, another or a retired format, another
                fingerprint, content that does not match its checksum, a corrupt Zephon checkpoint or one with another
                lane count, a malformed epoch, pass_ended or stats. Each
                message names the field.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state_dict: got {type(state).__name__}, expected the dict returned by ZephonLoader.state_dict()"
            )
        if not state:
            raise ValueError(
                "state_dict: got an empty dict, expected the dict returned by ZephonLoader.state_dict(); "
                "to start from the beginning, do not call load_state_dict"
            )
        format_ = state.get("format")
        if format_ != STATE_FORMAT:
            why = RETIRED_FORMATS.get(format_) if isinstance(format_, str) else None
            raise ValueError(
                f"state_dict.format: got {format_!r}, expected {STATE_FORMAT!r}; "
                + (f"{why}; resume it with the zephon_loader version that saved it, or start a new pass "
                   "(do not call load_state_dict)" if why else
                   "this state was not saved by this version of ZephonLoader.state_dict()")
            )
        saved = state.get("fingerprint")
        fingerprint = schedule_as_of(fingerprint, saved)
        if saved != fingerprint:
            saved = saved if isinstance(saved, Mapping) else {}
            differing = sorted(key for key in set(saved) | set(fingerprint) if saved.get(key) != fingerprint.get(key))
            details = "; ".join(describe_difference(key, saved.get(key), fingerprint.get(key)) for key in differing[:6])
            raise ValueError(
                f"state_dict.fingerprint: the state was saved by a loader with a different configuration ({details}); "
                "resume with the configuration it was saved with"
            )
        _check_integrity(state)
        _check_keys(state)
        checkpoint = state.get("zephon_checkpoint")
        if checkpoint is not None and not isinstance(checkpoint, Mapping):
            raise ValueError(
                f"state_dict.zephon_checkpoint: got {type(checkpoint).__name__}, no Zephon checkpoint found; expected "
                "the dict returned by ZephonLoader.state_dict() (the state is truncated or corrupt)"
            )
        try:
            if checkpoint is not None:
                check_checkpoint(checkpoint)
        except Exception as error:  # Zephon raises several types for a bad schema
            raise ValueError(f"state_dict: the Zephon checkpoint inside is corrupt or incompatible: {error}") from error
        world = checkpoint.get("world") if checkpoint is not None else None
        saved_lanes = world.get("canonical_replicas") if isinstance(world, Mapping) else None
        if saved_lanes is not None and saved_lanes != canonical_replicas:
            raise ValueError(
                f"state_dict.zephon_checkpoint.world.canonical_replicas: saved {saved_lanes!r}, now {canonical_replicas}; "
                "Zephon cannot re-deal a stream into another number of lanes; resume with distributed.canonical_replicas: "
                f"{saved_lanes} (any DP size that divides it)"
            )
        epoch = checked_epoch(state.get("epoch", _OPTIONAL["epoch"]), "state_dict.epoch")
        pass_ended = state.get("pass_ended", _OPTIONAL["pass_ended"])
        if not isinstance(pass_ended, bool):
            raise ValueError(f"state_dict.pass_ended: got {pass_ended!r}, expected a bool (whether the epoch's pass "
                             "was read to its end)")
        skip = checked_skip(state["skip"], "state_dict.skip", canonical_replicas)
        chains = {}
        for key in ("carried", "carry"):
            links = state[key]
            if not isinstance(links, list):
                raise ValueError(f"state_dict.{key}: got {type(links).__name__}, expected a list of "
                                 "{'epoch', 'zephon_checkpoint', 'skip'} (empty when nothing was carried)")
            seen: dict[str, int] = {}
            for index, link in enumerate(links):
                where = f"state_dict.{key}[{index}]"
                checked = checked_link(link, where)
                checked_skip(checked["skip"], f"{where}.skip", canonical_replicas)
                if checked["epoch"] > epoch:
                    raise ValueError(f"{where}.epoch: got {checked['epoch']}, expected at most the state's epoch "
                                     f"{epoch} (a carried pipeline is an earlier epoch's); {_TAMPERED}")
                first = seen.setdefault(content_checksum({"link": checked}), index)
                if first != index:
                    raise ValueError(f"{where}: the same pipeline position as state_dict.{key}[{first}], expected "
                                     f"each carried pipeline once (twice would deliver its batches twice); {_TAMPERED}")
                try:
                    if link["zephon_checkpoint"] is not None:
                        check_checkpoint(link["zephon_checkpoint"])
                except Exception as error:
                    raise ValueError(f"{where}: the Zephon checkpoint inside is corrupt or incompatible: "
                                     f"{error}") from error
            chains[key] = copy.deepcopy(links)
        return cls(
            format=STATE_FORMAT,
            fingerprint=copy.deepcopy(dict(saved)),
            epoch=epoch,
            pass_ended=pass_ended,
            zephon_checkpoint=copy.deepcopy(dict(checkpoint)) if checkpoint is not None else None,
            skip=skip,
            carried=chains["carried"],
            carry=chains["carry"],
            stats=_checked_stats(state.get("stats"), stats),
            phase=_checked_phase(state.get("phase"), canonical_replicas),
            lanes=_checked_lanes(state, canonical_replicas),
        )


_TAMPERED = ("the state was not made by ZephonLoader.state_dict() (edited, and its checksum recomputed); resume "
             "from an intact copy of the saved state")


#: Keys a state may lack, with the value that stands for them (documented: states of format 4 saved before epochs;
#: ``phase``: a loader without a mixture schedule).
_OPTIONAL = {"epoch": 0, "pass_ended": False, "phase": None, "lanes": None}


def state_paths(path: Any) -> list[str] | None:
    """The files a pattern of state files matches (``*``, or ``{dp_rank}`` standing for every rank: the per-rank
    states of ``distributed.state_scope: rank``), sorted; ``None`` when ``path`` is no pattern."""
    import glob

    text = str(path)
    if "*" not in text and "{dp_rank}" not in text:
        return None
    return sorted(glob.glob(text.replace("{dp_rank}", "*")))


def lane_ranges(lanes: Any) -> str:
    """``[0-3, 8, 10-11]``: sorted lanes with runs folded (a message names 1,024 lanes in a line)."""
    ordered, parts = sorted(int(lane) for lane in lanes), []
    for lane in ordered:
        if parts and parts[-1][1] == lane - 1:
            parts[-1][1] = lane
        else:
            parts.append([lane, lane])
    return "[" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) + "]"


def _checked_lanes(state: Mapping[str, Any], canonical_replicas: int) -> list[int] | None:
    """A state's ``lanes`` (``None``: every lane): sorted distinct ints in ``[0, canonical_replicas)``, and every
    lane-keyed part of the state within them (the current Zephon checkpoint holding exactly them)."""
    value = state.get("lanes")
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or any(isinstance(lane, bool) or not isinstance(lane, int) for lane in value)
            or value != sorted(set(value)) or value[0] < 0 or value[-1] >= canonical_replicas):
        raise ValueError(f"state_dict.lanes: got {str(value)[:80]}, expected a sorted list of distinct lanes in "
                         f"[0, {canonical_replicas}) (the lanes a rank's state holds); {_TAMPERED}")
    held = set(value)
    checkpoint = state.get("zephon_checkpoint")
    if checkpoint is not None and checkpoint_lanes(checkpoint) != held:
        raise ValueError(f"state_dict.zephon_checkpoint: holds lanes {lane_ranges(checkpoint_lanes(checkpoint))}, "
                         f"expected the state's lanes {lane_ranges(held)}; {_TAMPERED}")
    parts = [("skip", state.get("skip") or {})]
    for key in ("carried", "carry"):
        for index, link in enumerate(state.get(key) or []):
            parts.append((f"{key}[{index}].skip", link.get("skip") or {}))
            if link.get("zephon_checkpoint") is not None:
                parts.append((f"{key}[{index}].zephon_checkpoint", checkpoint_lanes(link["zephon_checkpoint"])))
    if isinstance(state.get("stats"), Mapping):
        parts.append(("stats.lanes", state["stats"].get("lanes") or {}))
    if isinstance(state.get("phase"), Mapping):
        parts.append(("phase.batches", state["phase"].get("batches") or {}))
    for where, lanes in parts:
        outside = {int(lane) for lane in lanes} - held
        if outside:
            raise ValueError(f"state_dict.{where}: holds lanes {lane_ranges(outside)} beyond the state's lanes "
                             f"{lane_ranges(held)}; {_TAMPERED}")
    return list(value)


def merge_states(states: list[LoaderState], canonical_replicas: int) -> LoaderState:
    """One state holding the lanes of every state of ``states``: several ranks' states (``state_scope: rank``) of
    one instant of a job, each checked by :meth:`LoaderState.from_dict`. A lane held by two states must be the
    same in both (model-parallel peers of one data-parallel rank save the same lanes). ``lanes`` is ``None`` when
    they cover every lane.

    Raises:
        ValueError: States of different instants (epoch, pass end, schedule phase, Zephon's round, the pipelines
            a pass still reads), or a lane with two different positions; each names ``states[i]``.
    """
    first = states[0]
    for index, state in enumerate(states[1:], start=1):
        for name in ("epoch", "pass_ended"):
            if getattr(state, name) != getattr(first, name):
                raise ValueError(f"load_state_dict: states[{index}].{name} is {getattr(state, name)!r}, "
                                 f"states[0].{name} {getattr(first, name)!r}; expected the states every rank saved "
                                 "at one step of one job")
        steps = [(s.stats or {}).get("steps") for s in (first, state)]
        if None not in steps and steps[0] != steps[1]:
            raise ValueError(f"load_state_dict: states[{index}] was taken after {steps[1]} step(s) of its pass, "
                             f"states[0] after {steps[0]}; expected the states every rank saved at one step of "
                             "one job (save each checkpoint's states in a folder of its own, and load one folder's)")
        if (state.phase or {}).get("index") != (first.phase or {}).get("index"):
            raise ValueError(f"load_state_dict: states[{index}] is in phase {(state.phase or {}).get('index')} of the "
                             f"schedule, states[0] in {(first.phase or {}).get('index')}; expected one step of one job")
        for key in ("carried", "carry"):
            ours, theirs = getattr(first, key), getattr(state, key)
            if [link["epoch"] for link in ours] != [link["epoch"] for link in theirs]:
                raise ValueError(f"load_state_dict: states[{index}].{key} holds epochs "
                                 f"{[link['epoch'] for link in theirs]}, states[0].{key} "
                                 f"{[link['epoch'] for link in ours]}; expected one step of one job")

    def union(parts: list[Mapping[str, Any]], where: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for index, part in enumerate(parts):
            for lane, value in part.items():
                if lane in out and out[lane] != value:
                    raise ValueError(f"load_state_dict: states[{index}].{where}[{lane}] is {value!r}, an earlier "
                                     f"state's {out[lane]!r}; expected one step of one job")
                out.setdefault(lane, value)
        return {lane: out[lane] for lane in sorted(out, key=int)}

    def merged_checkpoint(checkpoints: list[Any]) -> dict[str, Any] | None:
        present = [checkpoint for checkpoint in checkpoints if checkpoint is not None]
        if not present:
            return None
        if len(present) != len(checkpoints):
            raise ValueError("load_state_dict: some states are at the start of the epoch and others are not; "
                             "expected the states every rank saved at one step of one job")
        try:
            return merge_lane_checkpoints(present)
        except ValueError as error:
            raise ValueError(f"load_state_dict: {error}; expected the states every rank saved at one step of one "
                             "job") from error

    def merged_links(key: str) -> list[dict[str, Any]]:
        return [{"epoch": links[0]["epoch"],
                 "zephon_checkpoint": merged_checkpoint([link["zephon_checkpoint"] for link in links]),
                 "skip": union([link.get("skip") or {} for link in links], f"{key}[{i}].skip")}
                for i, links in enumerate(zip(*(getattr(state, key) for state in states)))]

    lanes = set().union(*(state.held_lanes(canonical_replicas) for state in states))
    stats = None
    if all(state.stats is not None for state in states):
        stats = LoaderStats.merge([{"owned": state.lanes, **state.stats} for state in states])
    phase = None
    if first.phase is not None:
        phase = {"index": first.phase["index"],
                 "batches": union([state.phase["batches"] for state in states if state.phase], "phase.batches")}
    return dataclasses.replace(
        first,
        zephon_checkpoint=merged_checkpoint([state.zephon_checkpoint for state in states]),
        skip=union([state.skip for state in states], "skip"),
        carried=merged_links("carried"), carry=merged_links("carry"), stats=stats, phase=phase,
        lanes=None if len(lanes) == canonical_replicas else sorted(lanes))


def schedule_as_of(fingerprint: Mapping[str, Any], saved: Any) -> Mapping[str, Any]:
    """The loader's ``fingerprint`` as a state saved in phase ``k`` of a mixture schedule compares it: its
    ``schedule`` cut to the phases the state holds (the past and the current one, ``k + 1``). Phases that had not
    begun when the state was saved may change; the others are compared."""
    if not (isinstance(saved, Mapping) and isinstance(saved.get("schedule"), list)
            and isinstance(fingerprint.get("schedule"), list)):
        return fingerprint
    return {**fingerprint, "schedule": fingerprint["schedule"][:len(saved["schedule"])]}


def _checked_phase(value: Any, lanes: int) -> dict[str, Any] | None:
    """A state's ``phase``: ``None`` or ``{"index": int >= 0, "batches": {"<lane>": int >= 0}}``."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"index", "batches"}:
        raise ValueError(f"state_dict.phase: got {value!r}, expected {{'index': int, 'batches': {{'<lane>': int}}}} "
                         f"(a mixture schedule's phase); {_TAMPERED}")
    index = value["index"]
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"state_dict.phase.index: got {index!r}, expected an int >= 0; {_TAMPERED}")
    return {"index": index, "batches": checked_skip(value["batches"], "state_dict.phase.batches", lanes)}


def _check_keys(state: Mapping[str, Any]) -> None:
    """Refuse a state without a key :meth:`LoaderState.to_dict` writes (but :data:`_OPTIONAL`), or with others (a
    removed ``skip`` would resume at its checkpoint and deliver the batches after it twice)."""
    expected = [field.name for field in dataclasses.fields(LoaderState)]
    missing = [key for key in expected if key not in state and key not in _OPTIONAL]
    if missing:
        raise ValueError(f"state_dict.{missing[0]}: missing, expected every key ZephonLoader.state_dict() writes "
                         f"({', '.join(expected)}, checksum); {_TAMPERED}")
    unknown = sorted(str(key) for key in set(state) - set(expected) - {"checksum"})
    if unknown:
        raise ValueError(f"state_dict: got the unknown key(s) {unknown}, expected only the keys "
                         f"ZephonLoader.state_dict() writes ({', '.join(expected)}, checksum); {_TAMPERED}")


def content_checksum(state: Mapping[str, Any]) -> str:
    """``"sha256:<64 hex>"`` of a state's keys other than ``checksum``, as canonical JSON (keys sorted, no
    spaces): the same before and after a JSON or ``torch.save`` round trip (tuples and lists read alike).

    Raises:
        ValueError: A value JSON cannot hold (a state is plain dicts, lists, numbers, strings).
    """
    body = _with_string_keys({key: value for key, value in state.items() if key != "checksum"})
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise ValueError(f"state_dict: holds a value that is not plain JSON ({error}); expected the dict "
                         "returned by ZephonLoader.state_dict()") from error
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _with_string_keys(node: Any) -> Any:
    """``node`` with every mapping key as JSON writes it (``1`` -> ``"1"``), so keys sort the same after a
    JSON round trip as before it."""
    if isinstance(node, Mapping):
        return {json.dumps(key) if not isinstance(key, str) else key: _with_string_keys(value)
                for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [_with_string_keys(value) for value in node]
    return node


def _check_integrity(state: Mapping[str, Any]) -> None:
    """Refuse a state whose content is not what :meth:`LoaderState.to_dict` made."""
    saved = state.get("checksum")
    if saved is None:
        raise ValueError("state_dict.checksum: missing; expected the checksum ZephonLoader.state_dict() adds "
                         "(the state is truncated or was edited); resume from an intact copy of the saved state")
    computed = content_checksum(state)
    if saved != computed:
        raise ValueError(
            f"state_dict.checksum: the content does not match its checksum (saved {str(saved)[:23]!r}..., content "
            f"{computed[:23]!r}...): the state was edited or damaged after ZephonLoader.state_dict() made it; "
            "resume from an intact copy (a state is read, never edited)"
        )


def _checked_stats(saved: Any, stats: LoaderStats | None) -> dict[str, Any] | None:
    """A deep copy of the saved accounting once a fresh copy of ``stats`` loaded it; ``None`` without accounting."""
    if stats is None:
        return None
    if not isinstance(saved, Mapping):
        raise ValueError(f"state_dict.stats: got {type(saved).__name__}, expected the accounting dict "
                         "returned by ZephonLoader.state_dict()")
    LoaderStats(stats.source_names, stats.drop_log, stats.reasons).load_state_dict(saved)  # raises if malformed
    return copy.deepcopy(dict(saved))


def write_atomically(path: str | os.PathLike[str], write: Callable[[Any], None], *, binary: bool = False) -> None:
    """Write a file at ``path`` with ``write(handle)`` via a temporary file beside it, fsync and rename.

    A failure (a full disk, a signal) leaves the previous file at ``path`` whole and no temporary file
    behind; parent folders are made. The rename is made durable by an fsync of the folder.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    _remove_dead_temporaries(folder, os.path.basename(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        try:
            descriptor = os.open(folder, os.O_RDONLY)
        except OSError:  # a folder that cannot be opened (some network file systems): the rename stands
            return
        try:
            os.fsync(descriptor)
        except OSError:
            pass
        finally:
            os.close(descriptor)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


#: This machine in a temporary file's name, so that a save on a shared folder never removes another machine's.
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _remove_dead_temporaries(folder: str, name: str) -> None:
    """Remove the temporary files of earlier saves of ``name`` killed mid-write (``kill -9``: no ``finally`` ran):
    only this machine's (``.<name>.<host>.<pid>.<thread>.tmp``, or an older version's ``.<name>.<pid>.<thread>.tmp``)
    whose process is gone; a live save's file is left alone."""
    prefix = f".{name}."
    try:
        entries = [e for e in os.listdir(folder) if e.startswith(prefix) and e.endswith(".tmp")]
    except OSError:
        return
    for entry in entries:
        parts = entry[len(prefix):-len(".tmp")].split(".")
        host, pid = (parts[0], parts[1]) if len(parts) == 3 else (_HOST, parts[0]) if len(parts) == 2 else ("", "")
        if host != _HOST or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, entry))
        except OSError:
            pass  # another save removed it first, or a read-only folder: the next save tries again


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def write_json_atomically(path: str | os.PathLike[str], document: Any) -> None:
    """``document`` as JSON at ``path``, atomically (:func:`write_atomically`)."""
    write_atomically(path, lambda handle: json.dump(document, handle))


def save_state_file(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """A loader state at ``path``, atomically: JSON when the name ends in ``.json``, else ``torch.save``
    (loadable with ``torch.load(..., weights_only=True)``: plain dicts, lists, ints, strings)."""
    if os.fspath(path).endswith(".json"):
        write_json_atomically(path, state)
        return
    import torch

    write_atomically(path, lambda handle: torch.save(dict(state), handle), binary=True)


def read_state_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What :func:`save_state_file` wrote (``torch.load`` with ``weights_only=True`` unless it is JSON).

    Raises:
        FileNotFoundError: No file at ``path``.
        ValueError: The file is neither (truncated, another format), naming the path.
    """
    path = os.fspath(path)
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as handle:
                state = json.load(handle)
        else:
            import torch

            state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # json, pickle and zip errors of a damaged file
        raise ValueError(f"loader state {path}: unreadable ({type(error).__name__}: {error}); expected a file "
                         "written by ZephonLoader.save_state") from error
    if not isinstance(state, dict):
        raise ValueError(f"loader state {path}: holds {type(state).__name__}, expected the dict "
                         "ZephonLoader.save_state writes")
    return state
