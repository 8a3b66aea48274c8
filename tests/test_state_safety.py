"""State and lifecycle safety of ZephonLoader (issue 9, parts 3 and 4).

* A state does not depend on ``read_ahead`` (a performance knob): saved with
  one depth, it resumes exactly with another.
* Retired, malformed and other-lane-count states are refused at
  ``load_state_dict`` with a ``ValueError`` naming the field.
* ``state_dict()`` from another thread, concurrent with ``next()`` or racing
  ``iter()``: never an error, always a state that resumes exactly.
* A new ``iter()`` makes the previous iterator stale (``RuntimeError``).
* A loader dropped without ``close()`` releases its threads, Zephon's workers
  and its temporary folders.
"""

from __future__ import annotations

import collections
import gc
import glob
import json
import os
import tempfile
import threading
import time
import weakref

import pytest
import torch

from conftest import collect
from zephon_loader import fields as F
from zephon_loader.build import build_text_loader
from zephon_loader.state import content_checksum


@pytest.fixture(scope="module")
def sources(jsonl_sources):
    return [{"name": name, "path": str(path), "weight": 1.0 + i} for i, (name, path) in enumerate(sorted(jsonl_sources.items()))]


def config(sources, tokenizer_dir, read_ahead, **overrides):
    base = {
        "sources": sources,
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 48,
        "micro_batch_size": 3,
        "seed": 7,
        "read_ahead": read_ahead,
        "contract": {"attn_implementation": "fa4"},
        "runtime": {"runner": "threads"},
    }
    base.update(overrides)
    return base


def input_ids(batches) -> list[torch.Tensor]:
    return [batch[F.INPUT_IDS] for batch in batches]


def wait_for_read_ahead(loader, depth: int) -> None:
    """Let the background thread pull its full depth: the state is then cut ``depth`` batches behind Zephon."""
    deadline = time.monotonic() + 30
    while loader._read_ahead.buffered < depth and time.monotonic() < deadline:
        time.sleep(0.005)


def resume_index(cfg, state, full) -> int:
    """Where a loader resumed from ``state`` starts in ``full``; asserts it then yields exactly ``full[index:]``."""
    with build_text_loader(cfg) as loader:
        loader.load_state_dict(json.loads(json.dumps(state)))
        rest = input_ids(collect(loader))
    index = len(full) - len(rest)
    assert 0 <= index <= len(full)
    assert all(torch.equal(got, want) for got, want in zip(rest, full[index:])), f"resumed stream diverges at {index}"
    return index


# ----------------------------------------------------------------------------- read_ahead-independent state


@pytest.mark.parametrize(("saved_with", "resumed_with"), [(0, 2), (2, 5), (2, 0), (5, 0)])
def test_state_saved_with_another_read_ahead_resumes_exactly(sources, tokenizer_dir, saved_with, resumed_with):
    with build_text_loader(config(sources, tokenizer_dir, resumed_with)) as loader:
        full = input_ids(collect(loader))
    assert len(full) > 6
    for taken in (0, 3, len(full)):
        with build_text_loader(config(sources, tokenizer_dir, saved_with)) as first:
            it = iter(first)
            for _ in range(taken):
                next(it)
            wait_for_read_ahead(first, saved_with if taken < len(full) - saved_with else 0)
            state = first.state_dict()
        assert "buffered" not in state  # cut before the read-ahead: no batch travels in the state
        assert resume_index(config(sources, tokenizer_dir, resumed_with), state, full) == taken


@pytest.mark.parametrize("read_ahead", [0, 3])
def test_state_cut_between_anchors_drops_what_was_delivered(sources, tokenizer_dir, monkeypatch, read_ahead):
    """With anchors far apart, a state is an older checkpoint plus per-lane batches to drop: still exact.

    Inline (read_ahead 0) the state is cut now unless the consumer is behind: it says so with set_consumed."""
    from zephon_loader.nodes.readahead import ReadAhead

    monkeypatch.setattr(ReadAhead, "ANCHOR_COST_RATIO", 10**9)  # only the pull cap takes anchors
    monkeypatch.setattr(ReadAhead, "ANCHOR_MAX_PULLS", 4)
    cfg = config(sources, tokenizer_dir, read_ahead, distributed={"canonical_replicas": 2})
    with build_text_loader(cfg) as loader:
        full = input_ids(collect(loader))
    assert len(full) > 9
    skipped = []
    for taken in (1, 2, 3, 5, 7, 9):
        with build_text_loader(cfg) as first:
            it = iter(first)
            for _ in range(taken):
                next(it)
            wait_for_read_ahead(first, read_ahead)
            behind = 0 if read_ahead else 1
            if behind:
                first.set_consumed(taken - behind)
            state = first.state_dict()
        skipped.append(sum(state.get("skip", {}).values()))
        taken -= behind
        assert resume_index(cfg, state, full) == taken
        # A state taken right after the resume, before anything new was delivered, carries the same position.
        with build_text_loader(cfg) as again:
            again.load_state_dict(json.loads(json.dumps(state)))
            it = iter(again)
            next(it)
            wait_for_read_ahead(again, read_ahead)
            later = again.state_dict()
        assert resume_index(cfg, later, full) == taken + 1
    assert any(skipped), f"no state needed dropping batches ({skipped}): the test would prove nothing"


def test_retired_malformed_and_other_lane_count_states_are_refused(sources, tokenizer_dir):
    cfg = config(sources, tokenizer_dir, 2, distributed={"canonical_replicas": 2})
    with build_text_loader(cfg) as loader:
        it = iter(loader)
        next(it)
        wait_for_read_ahead(loader, 2)
        state = json.loads(json.dumps(loader.state_dict()))
    assert set(state["stats"]["lanes"]) == {"0"}, "one batch delivered, from lane 0: counted per lane"

    def refused(change, match):
        bad = json.loads(json.dumps(state))
        change(bad)
        bad["checksum"] = content_checksum(bad)  # sealed again: these checks are behind the checksum
        with build_text_loader(cfg) as fresh:
            with pytest.raises(ValueError, match=match):
                fresh.load_state_dict(bad)

    refused(lambda s: s.update(format="zephon_loader.state/1", loader={"root": {}}),
            r"state_dict\.format: got 'zephon_loader\.state/1'.*earlier zephon_loader.*depended on read_ahead")
    refused(lambda s: s.update(format="zephon_loader.state/2"),
            r"state_dict\.format: got 'zephon_loader\.state/2'.*carried every rank's read-ahead batches")
    refused(lambda s: s["stats"].update(lanes={"0": {"batches": "x", "delivered": {}}}),
            r"state_dict\.stats: malformed")
    refused(lambda s: s.update(carried={}), r"state_dict\.carried: got dict, expected a list")
    refused(lambda s: s.update(carry=[{"epoch": 0}]), r"state_dict\.carry\[0\]: got .*expected \{'epoch'")
    refused(lambda s: s.update(carried=[{"epoch": 0, "zephon_checkpoint": {"version": 2}, "skip": {}}]),
            r"state_dict\.carried\[0\]: the Zephon checkpoint inside is corrupt")
    refused(lambda s: s.update(skip={"9": 1}), r"state_dict\.skip: got lane '9', expected a lane id in \[0, 2\)")
    refused(lambda s: s.update(skip={"0": -1}), r"state_dict\.skip\['0'\]: got -1, expected an int >= 0")
    refused(lambda s: s.update(carry=[{"epoch": -1, "zephon_checkpoint": None, "skip": {}}]),
            r"state_dict\.carry\[0\]\.epoch: got -1, expected an int >= 0")
    refused(lambda s: s.update(carried=[{"epoch": 0, "zephon_checkpoint": None, "skip": {"0": "x"}}]),
            r"state_dict\.carried\[0\]\.skip\['0'\]: got 'x', expected an int >= 0")
    # The fingerprint names canonical_replicas too; the Zephon checkpoint itself is checked as well.
    with build_text_loader(config(sources, tokenizer_dir, 2)) as one_lane:
        other = json.loads(json.dumps(state))
        other["fingerprint"] = json.loads(json.dumps(one_lane.fingerprint))
        other["checksum"] = content_checksum(other)
        with pytest.raises(ValueError, match=r"zephon_checkpoint\.world\.canonical_replicas: saved 2, now 1"):
            one_lane.load_state_dict(other)


def _first_int_path(node, path=()):
    """The key path of the first int inside a nested state (a Zephon cursor or count)."""
    if isinstance(node, bool):
        return None
    if isinstance(node, int):
        return path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found = _first_int_path(value, (*path, key))
        if found is not None:
            return found
    return None


def test_an_edited_or_damaged_state_is_refused_by_its_checksum(sources, tokenizer_dir, tmp_path):
    """Before: pass_ended flipped to true mid-pass skipped the rest of the pass; a Zephon cursor moved by +3
    resumed 1 batch and ended the pass. Both were accepted. Now the checksum refuses them in one line."""
    cfg = config(sources, tokenizer_dir, 2)
    with build_text_loader(cfg) as loader:
        full = input_ids(collect(loader))
    with build_text_loader(cfg) as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = loader.state_dict()
    assert state["checksum"].startswith("sha256:") and list(state)[-1] == "checksum"
    cursor = _first_int_path(state["zephon_checkpoint"])
    assert cursor is not None

    def move_cursor(s):
        node = s["zephon_checkpoint"]
        for key in cursor[:-1]:
            node = node[key]
        node[cursor[-1]] += 3

    edits = {
        "pass_ended flipped": lambda s: s.update(pass_ended=True),
        "cursor moved": move_cursor,
        "skip changed": lambda s: s["skip"].update({"0": s["skip"].get("0", 0) + 1}),
        "checksum removed": lambda s: s.pop("checksum"),
        "checksum garbled": lambda s: s.update(checksum="sha256:" + "0" * 64),
    }
    for what, edit in edits.items():
        bad = json.loads(json.dumps(state))
        edit(bad)
        with build_text_loader(cfg) as fresh:
            with pytest.raises(ValueError, match=r"^state_dict\.checksum: (missing|the content does not match)") as caught:
                fresh.load_state_dict(bad)
        assert "\n" not in str(caught.value), what
    # Round trips keep the checksum valid: JSON, torch.save (weights_only), save_state.
    for name in ("s.json", "s.pt"):
        with build_text_loader(cfg) as fresh:
            fresh.load_state_dict(json.loads(json.dumps(state)) if name.endswith("json") else
                                  torch.load(_saved(state, tmp_path / name), weights_only=True))
            assert [torch.equal(a, b) for a, b in zip(input_ids(collect(fresh)), full[4:])] == [True] * (len(full) - 4)
    # The previous format (no checksum, a fingerprint of the shards' edges only) is retired, saying why.
    legacy = {key: value for key, value in json.loads(json.dumps(state)).items() if key != "checksum"}
    legacy["format"] = "zephon_loader.state/3"
    with build_text_loader(cfg) as fresh:
        with pytest.raises(ValueError, match=r"state_dict\.format: got 'zephon_loader\.state/3'.*carried no checksum"):
            fresh.load_state_dict(legacy)


def _saved(state, path):
    torch.save(state, path)
    return path


# ----------------------------------------------------------------------------- threads


def test_one_iterator_from_two_threads_at_once_is_a_clear_error(sources, tokenizer_dir):
    """Before: two threads advancing one iterator raised KeyError('delivered') from inside the loader (when the
    issue was filed), then split the stream between them without a word (each got every other batch). Now a
    second thread entering next() while the first is inside gets one clear RuntimeError; the first thread's
    batch and the stream after it are unharmed, and handing the iterator to another thread in turn works."""
    inside, release = threading.Event(), threading.Event()
    calls = []

    def wrapper(collate):  # AutoModel-style; with read_ahead 0 the wrapped collate runs inside the consumer's next()
        def wrapped(batch):
            calls.append(1)
            if len(calls) == 2:
                inside.set()
                assert release.wait(60)
            return collate(batch)
        return wrapped

    cfg = config(sources, tokenizer_dir, 0)
    with build_text_loader(cfg) as loader:
        full = input_ids(collect(loader))
    with build_text_loader(cfg, collate_wrapper=wrapper) as loader:
        it = iter(loader)
        got = [next(it)[F.INPUT_IDS]]
        first = threading.Thread(target=lambda: got.append(next(it)[F.INPUT_IDS]))
        first.start()
        assert inside.wait(60)
        with pytest.raises(RuntimeError, match=r"next\(\) called from thread .* while another thread .* inside next\(\)"
                                               r".*one consumer at a time"):
            next(it)
        release.set()
        first.join(60)
        later = threading.Thread(target=lambda: got.extend(b[F.INPUT_IDS] for b in it))  # handed on: fine
        later.start()
        later.join(120)
    assert len(got) == len(full) and all(torch.equal(a, b) for a, b in zip(got, full))


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_state_dict_from_another_thread_during_next_resumes_exactly(sources, tokenizer_dir, read_ahead):
    """Free-running consumer thread; states taken meanwhile from this thread. A state taken while
    ``k`` batches were consumed (one ``next()`` possibly in flight) resumes at batch ``k`` or ``k + 1``."""
    cfg = config(sources, tokenizer_dir, read_ahead)
    with build_text_loader(cfg) as loader:
        full = input_ids(collect(loader))
    consumed: list[torch.Tensor] = []
    states = []
    with build_text_loader(cfg) as loader:
        it = iter(loader)

        def consume():
            for batch in it:
                consumed.append(batch[F.INPUT_IDS])
                time.sleep(0.002)

        consumer = threading.Thread(target=consume)
        consumer.start()
        while consumer.is_alive() and len(states) < 5:
            before = len(consumed)
            state = loader.state_dict()
            states.append((before, len(consumed), state))
            time.sleep(0.01)
        consumer.join()
    assert all(torch.equal(got, want) for got, want in zip(consumed, full)) and len(consumed) == len(full)
    for before, after, state in states:
        index = resume_index(cfg, state, full)
        assert before <= index <= after + 1, (before, after, index)


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_state_dict_racing_iter_never_fails_and_stays_exact(sources, tokenizer_dir, read_ahead):
    cfg = config(sources, tokenizer_dir, read_ahead)
    with build_text_loader(cfg) as loader:
        full = input_ids(collect(loader))
    errors: list[str] = []
    # Bounded: a state can be ~1 MB (Zephon's checkpoint), and a tight loop takes thousands of them.
    taken: collections.deque = collections.deque(maxlen=64)
    with build_text_loader(cfg) as loader:
        stop = threading.Event()

        def take_states():
            while not stop.is_set():
                try:
                    taken.append(loader.state_dict())
                except Exception as error:  # before issue 9: AttributeError / "cannot join thread"
                    errors.append(f"{type(error).__name__}: {error}")
                time.sleep(0.0005)  # keep racing, but let the consumer get the locks (they are not fair)

        taker = threading.Thread(target=take_states)
        taker.start()
        try:
            for _ in range(15):
                it = iter(loader)
                next(it)
                next(it)
        finally:
            stop.set()
            taker.join()
        assert errors == []
        assert taken
        final = loader.state_dict()
    assert resume_index(cfg, final, full) == 2
    assert resume_index(cfg, taken[len(taken) // 2], full) in (0, 1, 2)


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_a_new_iter_makes_the_previous_iterator_stale(sources, tokenizer_dir, read_ahead):
    with build_text_loader(config(sources, tokenizer_dir, read_ahead)) as loader:
        first = iter(loader)
        a = next(first)
        second = iter(loader)
        b = next(second)
        with pytest.raises(RuntimeError, match=r"stale.*iter\(loader\)"):
            next(first)
        c = next(second)  # the failed advance did not move the new pass
        assert torch.equal(a[F.INPUT_IDS], b[F.INPUT_IDS])
        assert not torch.equal(b[F.INPUT_IDS], c[F.INPUT_IDS])
        loader.preview()
        with pytest.raises(RuntimeError, match="stale"):
            next(second)
        assert torch.equal(next(iter(loader))[F.INPUT_IDS], a[F.INPUT_IDS])


# ----------------------------------------------------------------------------- lifecycle


def _child_processes() -> int:
    me = str(os.getpid())
    count = 0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        count += fields[1] == me
    return count


def test_dropped_loaders_release_threads_workers_and_temporary_folders(sources, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the builder's folders land here
    cfg = config(sources, None, 2, tokenizer={})  # the recipe's tokenizer object: the builder saves a folder

    def drop_one():
        loader = build_text_loader(cfg, tokenizer=tokenizer)
        it = iter(loader)
        next(it)
        next(it)
        del it, loader  # no close()
        gc.collect()

    drop_one()
    threads, children, folders = threading.active_count(), _child_processes(), sorted(os.listdir(tmp_path))
    for _ in range(10):
        drop_one()
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("zephon")]
    assert threading.active_count() <= threads, f"threads grew from {threads}: {leaked}"
    assert _child_processes() <= children
    assert sorted(os.listdir(tmp_path)) == folders, "temporary folders grew"
    assert [name for name in folders if name.startswith("zephon_loader_")] == [], "the builder's folders stayed"


def test_release_from_the_read_ahead_thread_itself(sources, tokenizer_dir):
    """Garbage collection may run the finalizer inside the read-ahead thread: it must neither join
    itself nor leave anything running."""
    before = threading.active_count()
    closed = []
    loader_box = []

    def wrapper(base):
        def wrapped(examples):
            if loader_box:  # the second transform, in the read-ahead thread: finalize from there
                loader_box.pop()._finalizer()
            return base(examples)

        return wrapped

    from zephon_loader.loader import _release

    loader = build_text_loader(config(sources, tokenizer_dir, 2), collate_wrapper=wrapper)
    _, _, (read_ahead, source, on_close), _ = loader._finalizer.detach()

    def observed_on_close():
        if on_close is not None:
            on_close()  # the builder's own (temporary folders)
        closed.append(threading.current_thread().name)

    loader._finalizer = weakref.finalize(loader, _release, read_ahead, source, observed_on_close)
    it = iter(loader)
    next(it)
    loader_box.append(loader)
    next(it)  # frees a slot: the read-ahead thread pulls and transforms the next batch
    deadline = time.monotonic() + 30
    while (not closed or threading.active_count() > before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == ["zephon-loader-release"]  # moved off the read-ahead thread
    assert threading.active_count() <= before
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


# ----------------------------------------------------------------------------- files and misuse (issue 19)


@pytest.mark.parametrize("name", ["state.pt", "state.json"])
def test_save_state_is_atomic_and_resumes_exactly(sources, tokenizer_dir, tmp_path, monkeypatch, name):
    """save_state/load_state round trip (torch.load weights_only or JSON); a write that fails midway (a full
    disk) leaves the previous file whole and no temporary file."""
    import errno
    import os

    import zephon_loader.state as state_module

    cfg = config(sources, tokenizer_dir, 2)
    with build_text_loader(cfg) as loader:
        full = input_ids(collect(loader))
    path = tmp_path / "deep" / name
    with build_text_loader(cfg) as first:
        it = iter(first)
        for _ in range(3):
            next(it)
        first.save_state(path)
        before = path.read_bytes()
        next(it)
        real_fsync = os.fsync

        def full_disk(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(state_module.os, "fsync", full_disk)
        with pytest.raises(OSError, match="No space left"):
            first.save_state(path)
        monkeypatch.setattr(state_module.os, "fsync", real_fsync)
    assert path.read_bytes() == before, "the previous state was damaged by the failed save"
    assert [p.name for p in path.parent.iterdir()] == [name], "a temporary file was left behind"
    if name.endswith(".pt"):
        torch.load(path, weights_only=True)
    with build_text_loader(cfg) as resumed:
        resumed.load_state(path)
        rest = input_ids(collect(resumed))
    assert len(rest) == len(full) - 3 and all(torch.equal(a, b) for a, b in zip(rest, full[3:]))
    damaged = tmp_path / ("bad" + path.suffix)
    damaged.write_bytes(before[: len(before) // 2])
    with build_text_loader(cfg) as fresh:
        with pytest.raises(ValueError, match=r"loader state .*bad.*unreadable"):
            fresh.load_state(damaged)


def test_load_state_dict_makes_a_live_iterator_stale(sources, tokenizer_dir):
    """Loading a state while iterating: the old iterator must not go on with the old stream."""
    cfg = config(sources, tokenizer_dir, 2)
    with build_text_loader(cfg) as loader:
        full = input_ids(collect(loader))
    with build_text_loader(cfg) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        for _ in range(3):
            next(it)
        loader.load_state_dict(state)
        with pytest.raises(RuntimeError, match=r"stale.*load_state_dict"):
            next(it)
        assert loader.state_dict() == state
        rest = input_ids(collect(loader))
    assert len(rest) == len(full) - 1 and all(torch.equal(a, b) for a, b in zip(rest, full[1:]))


# ----------------------------------------------------------------------------- issue 37: semantics behind the checksum


def test_a_tampered_state_with_its_checksum_recomputed_is_refused_by_what_it_says(sources, tokenizer_dir):
    """The checksum is an unkeyed SHA-256 anyone can recompute: with it a removed ``skip``, a carried pipeline
    listed twice (a whole pass delivered again) and a skip of 10**6 were accepted. The content is checked too."""
    cfg = config(sources, tokenizer_dir, 0)
    with build_text_loader(cfg) as loader:
        it = iter(loader)
        for _ in range(2):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    link = {"epoch": 0, "zephon_checkpoint": None, "skip": {}}

    def sealed(change):
        bad = json.loads(json.dumps(state))
        change(bad)
        bad["checksum"] = content_checksum(bad)
        return bad

    for change, match in [
        (lambda s: s.pop("skip"), r"^state_dict\.skip: missing, expected every key ZephonLoader\.state_dict\(\) "
                                  r"writes .*checksum recomputed"),
        (lambda s: s.pop("carried"), r"^state_dict\.carried: missing"),
        (lambda s: s.update(extra=1), r"^state_dict: got the unknown key\(s\) \['extra'\]"),
        (lambda s: s.update(carried=[link, dict(link)]), r"^state_dict\.carried\[1\]: the same pipeline position as "
                                                          r"state_dict\.carried\[0\].*its batches twice"),
        (lambda s: s.update(carry=[dict(link, epoch=3)]), r"^state_dict\.carry\[0\]\.epoch: got 3, expected at most "
                                                           r"the state's epoch 0"),
        (lambda s: s.update(carried=[dict(link, skip={"5": 1})]), r"^state_dict\.carried\[0\]\.skip: got lane '5', "
                                                                  r"expected a lane id in \[0, 1\)"),
    ]:
        with build_text_loader(cfg) as fresh:
            with pytest.raises(ValueError, match=match):
                fresh.load_state_dict(sealed(change))
    with build_text_loader(cfg) as fresh:
        fresh.load_state_dict(sealed(lambda s: s.update(skip={"0": 10**6})))
        with pytest.raises(ValueError, match=r"^state_dict\.skip: lane 0 of epoch 0 ended with \d+ of the batches the "
                                             r"state says it delivered after its checkpoint still to skip"):
            collect(fresh)


def test_a_stale_set_consumed_is_named_at_state_dict(sources, tokenizer_dir):
    """``set_consumed`` not called again after more batches rewound the state one batch without a word; two gave
    "lag: got 2 ... retain=1", naming neither the call nor the fix."""
    with build_text_loader(config(sources, tokenizer_dir, 0)) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        loader.set_consumed(3)
        loader.state_dict()  # fresh: no word
        next(it)
        with pytest.warns(RuntimeWarning, match=r"state_dict: the last set_consumed\(3\) came 1 batch\(es\) ago \(4 "
                                                r"delivered now\): the state resumes after batch 3.*call set_consumed"):
            loader.state_dict()
        next(it)
        with pytest.raises(ValueError, match=r"^state_dict: the last set_consumed\(3\) came 2 batch\(es\) ago \(5 "
                                             r"delivered now\), expected a count at most 1 behind.*call "
                                             r"set_consumed\(<batches trained this pass>\)"):
            loader.state_dict()
        loader.set_consumed(5)
        loader.state_dict()


_KILLED_SAVE = r"""
import sys, time
from zephon_loader.state import write_atomically
def write(handle):
    handle.write("partial")
    handle.flush()
    open(sys.argv[2], "w").close()
    time.sleep(600)
write_atomically(sys.argv[1], write)
"""


def test_the_temporary_files_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    """``kill -9`` during ``save_state`` left ``.name.pid.tid.tmp`` files that piled up. The next save of the same
    name removes those of dead processes on this machine; a live save's and another name's are left."""
    import signal
    import subprocess
    import sys

    from zephon_loader.state import _HOST, save_state_file

    target = tmp_path / "state.json"
    killed = []
    for index in range(2):
        ready = tmp_path / f"ready{index}"
        child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(target), str(ready)],
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), "the child never started writing"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
        killed.append(sorted(p.name for p in tmp_path.glob(".state.json.*.tmp")))
    # each killed save left its file; the second save removed the first's before it was killed in turn
    assert [len(k) for k in killed] == [1, 1] and killed[0] != killed[1], killed
    assert f".{_HOST}.{child.pid}." in killed[1][0], killed
    legacy = tmp_path / f".state.json.{child.pid}.1.tmp"  # an older version's name, same dead process
    live = tmp_path / f".state.json.{_HOST}.{os.getpid()}.99.tmp"  # a save in progress in this process
    other = tmp_path / f".other.json.{_HOST}.{child.pid}.1.tmp"  # another target's
    for path in (legacy, live, other):
        path.write_text("partial")
    save_state_file(target, {"a": 1})
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == sorted([live.name, other.name]), left
    assert json.loads(target.read_text()) == {"a": 1}
