"""An iterator obtained before ``close()`` must not deliver anything afterwards: it raises a clear error.

Reported (issue 11): an iterator taken before ``close()`` yielded one buffered
batch and then ended quietly, as if the pass were over. Every way of reaching
``close()`` is covered: explicit, the ``with`` block, read-ahead on and off,
before and after the first batch, and with a batch already read ahead.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import yaml

from zephon_loader import build_text_loader

CLOSED = r"ZephonLoader is closed"


@pytest.fixture
def config_path(tmp_path, jsonl_sources, tokenizer_dir):
    def write(read_ahead: int):
        path = tmp_path / f"loader-{read_ahead}.yaml"
        path.write_text(yaml.safe_dump({"dataloader": {
            "sources": [{"name": n, "path": os.fspath(p)} for n, p in sorted(jsonl_sources.items())],
            "tokenizer": {"path": os.fspath(tokenizer_dir)},
            "sequence_length": 32, "micro_batch_size": 2, "read_ahead": read_ahead,
            "runtime": {"runner": "threads"},
        }}))
        return path

    return write


def _wait_until_buffered(loader, count: int) -> None:
    deadline = time.monotonic() + 30
    while loader._read_ahead.buffered < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader._read_ahead.buffered >= count  # the read-ahead thread filled its buffer


@pytest.mark.parametrize("read_ahead", [0, 2])
@pytest.mark.parametrize("taken_before_close", [0, 1, 3])
def test_iterator_from_before_close_raises(config_path, read_ahead, taken_before_close):
    loader = build_text_loader(config_path(read_ahead))
    iterator = iter(loader)
    for _ in range(taken_before_close):
        next(iterator)
    if read_ahead:
        _wait_until_buffered(loader, read_ahead)  # batches are waiting: none of them may come out
    loader.close()
    with pytest.raises(RuntimeError, match=CLOSED):
        next(iterator)
    with pytest.raises(RuntimeError, match=CLOSED):  # and again: it does not turn into a quiet StopIteration
        next(iterator)


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_for_loop_over_an_iterator_from_a_closed_with_block_raises(config_path, read_ahead):
    with build_text_loader(config_path(read_ahead)) as loader:
        iterator = iter(loader)
        first = next(iterator)
    assert first["input_ids"].shape == (2, 32)
    delivered = []
    with pytest.raises(RuntimeError, match=CLOSED):
        for batch in iterator:
            delivered.append(batch)
    assert delivered == []


def test_close_from_another_thread_stops_the_consumer_with_the_error(config_path):
    """close() in a supervisor thread while the training loop iterates: the loop's next step raises."""
    loader = build_text_loader(config_path(2))
    iterator = iter(loader)
    next(iterator)
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive()
    with pytest.raises(RuntimeError, match=CLOSED):
        next(iterator)


def test_new_iterators_and_state_are_refused_after_close(config_path):
    loader = build_text_loader(config_path(2))
    loader.close()
    for call in (lambda: iter(loader), loader.state_dict, loader.preview):
        with pytest.raises(RuntimeError, match=CLOSED):
            call()


@pytest.mark.parametrize("taken_before_close", [0, 1])
def test_read_ahead_node_refuses_next_after_close(config_path, taken_before_close):
    """The public ``ReadAhead`` node (``zephon_loader.ReadAhead``) after ``close()``: it delivered the batches
    it had read ahead, then raised StopIteration as if the pass had ended. It must raise until ``reset()``."""
    loader = build_text_loader(config_path(2))
    try:
        node = loader._read_ahead  # the loader's own node, fed by a real Zephon source
        iterator = iter(loader)
        for _ in range(taken_before_close):
            next(iterator)
        _wait_until_buffered(loader, 2)
        node.close()
        with pytest.raises(RuntimeError, match=r"close"):
            node.next()
        node.reset(None)  # a new pass works again
        assert node.next()["input_ids"].shape == (2, 32)
    finally:
        loader.close()
