"""``runtime.runner: ray``: the tokenize stage on Zephon's Ray runner (``zephon_loader.pipeline.ray_runner``).

* The batches of ``runner: threads``, bit for bit, over a small corpus; the
  loader starts a local Ray instance when none is up and shuts it down at
  ``close()``; it leaves a caller's instance up.
* Resume from a mid-run ``state_dict()`` is exact (and a ``threads`` state resumes under ``ray``).
* A bad record is refused with its source, shard and line, as under threads.
* Without ``ray``: one ``ImportError`` naming ``pip install 'zephon-loader[ray]'``; pretokenized input refused.

The tests that run Ray are skipped when ``ray`` is not installed. Each loader
under ``ray`` starts its actors (a Python process each, importing Zephon):
seconds on a busy machine, so the tokenize stage runs 2 actors here.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from conftest import collect, make_texts, text_config, write_jsonl_shards
from zephon_loader import build_text_loader
from zephon_loader.config import text_loader_config
from zephon_loader.errors import BadRecordError

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'zephon-loader[ray]')")

RAY = {"runner": "ray", "tokenize_parallelism": 2}


@pytest.fixture(scope="module")
def web(jsonl_sources: dict[str, Path]) -> Path:
    return jsonl_sources["a"]


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys(), index
        for name in b:
            if isinstance(b[name], torch.Tensor):
                assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (index, name)
            else:
                assert a[name] == b[name], (index, name)


@pytest.fixture(scope="module")
def threads_batches(web: Path, tokenizer_dir: Path) -> list[dict]:
    with build_text_loader(text_config(web, tokenizer_dir, runtime={"runner": "threads"})) as loader:
        batches = collect(loader)
    assert len(batches) >= 8
    return batches


@pytest.fixture()
def callers_ray():
    """A Ray instance the test starts (the caller's): the loader must use it and leave it up."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    from zephon_loader.pipeline.ray_runner import _on_loopback

    with _on_loopback():  # on 127.0.0.1, as the loader's own instance
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()


@needs_ray
def test_same_batches_as_threads_and_own_instance_shut_down(web, tokenizer_dir, threads_batches):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    loader = build_text_loader(text_config(web, tokenizer_dir, runtime=RAY))
    try:
        assert ray.is_initialized(), "the loader started no Ray instance"
        assert ray.util.get_node_ip_address() == "127.0.0.1", "the loader's Ray is not on loopback"
        got = collect(loader)
    finally:
        loader.close()
    assert not ray.is_initialized(), "the loader left the Ray instance it started running"
    assert_same_batches(got, threads_batches)


@needs_ray
def test_resume_is_exact_and_callers_instance_stays_up(web, tokenizer_dir, threads_batches, callers_ray):
    cfg = text_config(web, tokenizer_dir, runtime=RAY)
    k = 3
    with build_text_loader(cfg) as first:
        iterator = iter(first)
        head = [next(iterator) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
    assert callers_ray.is_initialized(), "the loader shut down the caller's Ray instance"
    with build_text_loader(cfg) as second:
        second.load_state_dict(state)
        rest = collect(second)
    assert_same_batches(head + rest, threads_batches)
    # A position saved under threads resumes under ray (the runner is not part of the stream).
    with build_text_loader(text_config(web, tokenizer_dir, runtime={"runner": "threads"})) as first:
        iterator = iter(first)
        for _ in range(k):
            next(iterator)
        state = first.state_dict()
    with build_text_loader(cfg) as second:
        second.load_state_dict(state)
        assert_same_batches(collect(second), threads_batches[k:])


@needs_ray
def test_bad_record_is_located_as_under_threads(tmp_path, tokenizer_dir, callers_ray):
    good = [json.dumps({"text": t}) for t in make_texts(12, seed=3, min_words=2, max_words=6)]
    lines = good[:8]
    lines.insert(5, '{"text": 7}')  # physical line 6
    folder = tmp_path / "web"
    write_jsonl_shards(folder, [json.loads(line) for line in good[8:]], shards=1)
    (folder / "part-00000.jsonl").rename(folder / "part-00001.jsonl")
    (folder / "part-00000.jsonl").write_text("".join(line + "\n" for line in lines))
    messages = {}
    for runtime in ({"runner": "threads"}, RAY):
        with build_text_loader(text_config(folder, tokenizer_dir, runtime=runtime)) as loader:
            with pytest.raises(BadRecordError) as info:
                collect(loader)
        messages[runtime["runner"]] = str(info.value)
    assert f"source 'web', shard {folder / 'part-00000.jsonl'}, line 6" in messages["ray"]
    assert "field 'text' got 7 (int)" in messages["ray"]
    assert messages["ray"] == messages["threads"]


def test_missing_ray_is_one_error_naming_the_extra(web, tokenizer_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"runtime\.runner: got 'ray'.*pip install 'zephon-loader\[ray\]'"):
        build_text_loader(text_config(web, tokenizer_dir, runtime={"runner": "ray"}))


def test_ray_needs_a_tokenize_stage(web):
    with pytest.raises(ValueError, match=r"runtime\.runner: got 'ray' with pretokenized input"):
        text_loader_config(sources=[{"name": "web", "path": str(web)}], sequence_length=32, micro_batch_size=2,
                           tokenizer={"pretokenized_field": "tokens"}, pad_token_id=0, runtime={"runner": "ray"})
    assert text_loader_config(sources=[{"name": "web", "path": str(web)}], sequence_length=32, micro_batch_size=2,
                              runtime={"runner": "ray"}).runtime.options() == {}


@needs_ray
def test_chat_batches_as_under_threads(chat_source, tokenizer_dir, callers_ray):
    """Chat mode on Ray: the actors load the tokenizer folder themselves; the batches are those of threads."""
    from conftest import CHAT_TEMPLATE

    def config(runtime):
        return {"sources": [{"name": "chat", "path": str(chat_source)}], "sequence_length": 64,
                "micro_batch_size": 2, "runtime": runtime,
                "tokenizer": {"path": str(tokenizer_dir), "chat_field": "messages", "chat_template": CHAT_TEMPLATE}}

    with build_text_loader(config({"runner": "threads"})) as loader:
        want = collect(loader)
    with build_text_loader(config(RAY)) as loader:
        got = collect(loader)
    assert want
    assert_same_batches(got, want)


# ----------------------------------------------------------------------------- Ctrl-C, SIGTERM, loopback

RAY_TRAINER = """\
import json
import sys

import ray

from zephon_loader import build_text_loader


def main():
    with open(sys.argv[1]) as handle:
        config = json.load(handle)
    step = 0
    loader = build_text_loader(config)
    if sys.argv[2] == "with":
        loader.__enter__()
    print("node", ray.util.get_node_ip_address(), *sorted({n["NodeManagerAddress"] for n in ray.nodes()}),
          flush=True)
    try:
        while True:
            for _ in loader:
                step += 1
                print(f"step {step}", flush=True)
    finally:
        if sys.argv[2] == "with":
            loader.__exit__(None, None, None)


if __name__ == "__main__":
    main()
"""

#: Bounds a hang or a second Ray instance (which took ~20 s): Ray's shutdown takes a few seconds here.
RAY_EXIT_BOUND_S = 60.0


def _listening_addresses(pids: set[int]) -> set[str]:
    """Local addresses the TCP sockets of ``pids`` listen on (Linux ``/proc``)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:
            continue
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address = fields[1].rsplit(":", 1)[0]
                if table == "tcp":
                    found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.add("::ffff:127.0.0.1" if address == "0000000000000000FFFF00000100007F" else address)
    return found


class _RayTrainer:
    """:data:`RAY_TRAINER` in its own session (``with``: the loader closed by a ``with``-style exit, or left
    open); its output lines read by a thread."""

    def __init__(self, folder: Path, config: dict, mode: str) -> None:
        import os
        import queue
        import subprocess
        import threading

        script, path = folder / "ray_trainer.py", folder / "config.json"
        script.write_text(RAY_TRAINER)
        path.write_text(json.dumps(config))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # SIGINT as a terminal leaves it: a test run started in the background (a CI job) inherits it ignored, and
        # Python then never raises KeyboardInterrupt (tests/test_cli.py does the same).
        self.proc = subprocess.Popen([sys.executable, str(script), str(path), mode], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(
            target=lambda: [self.lines.put(line.rstrip("\n")) for line in self.proc.stdout], daemon=True)
        self._reader.start()

    def wait_for(self, prefix: str, timeout: float) -> str:
        import queue
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout} s:\n" + "\n".join(self.seen)) from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def output(self) -> str:
        """Everything it printed (call once it exited: its output ends with its session's last process)."""
        self._reader.join(10)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "\n".join(self.seen)

    def session(self) -> list[tuple[int, int, str]]:
        from process_trainer import session_processes

        return session_processes(self.proc.pid)

    def left_after(self, seconds: float) -> list[tuple[int, int, str]]:
        import time

        deadline = time.monotonic() + seconds
        while (left := self.session()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def kill(self) -> None:
        """SIGKILL whatever is left of its session (Ray's processes may sit in process groups of their own)."""
        import os
        import signal

        for pid, _, _ in self.session():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


@needs_ray
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and sessions")
@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-c-unclosed", "sigterm"])
def test_ctrl_c_and_sigterm_end_the_run_and_its_ray_on_loopback(how, web, tokenizer_dir, tmp_path):
    """Ctrl-C (SIGINT to the process group) and SIGTERM during a ``runner: ray`` run, in its own session.

    Before: Ctrl-C with the loader left open could start a second Ray instance during exit (rc 1, "Can't
    find actor"); SIGTERM ended by Ray's handler (status 15, a C++ stack, at times SIGABRT), leaving Ray's
    agents behind once that handler was gone; Ray listened on the machine's network interface. Now: the
    usual status (130 with the loader closed, 143), one Ray instance, none of its processes left, every
    listening socket of the session on 127.0.0.1.
    """
    import os
    import signal

    mode = "unclosed" if how == "ctrl-c-unclosed" else "with"
    trainer = _RayTrainer(tmp_path, text_config(web, tokenizer_dir, runtime=RAY, read_ahead=2), mode)
    try:
        node = trainer.wait_for("node ", timeout=300)
        assert node.split()[1:] == ["127.0.0.1", "127.0.0.1"], node
        trainer.wait_for("step 3", timeout=300)
        listening = _listening_addresses({pid for pid, _, _ in trainer.session()})
        assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
        if how == "sigterm":
            trainer.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(trainer.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        status = trainer.proc.wait(RAY_EXIT_BOUND_S)
        left = trainer.left_after(RAY_EXIT_BOUND_S)
        output = trainer.output()
        # A loader left open closes at exit: Python's status for an uncaught KeyboardInterrupt is then 1.
        expected = {"sigterm": {-signal.SIGTERM}, "ctrl-c": {-signal.SIGINT}, "ctrl-c-unclosed": {-signal.SIGINT, 1}}
        assert status in expected[how], f"exit status {status}; output:\n{output[-5000:]}"
        assert output.count("Started a local Ray instance") == 1, output[-5000:]
        for sign in ("Can't find actor", "SIGTERM received", "SIGABRT"):
            assert sign not in output, output[-5000:]
        assert not left, f"processes left {RAY_EXIT_BOUND_S} s after the run ended ({how}): {left}"
    finally:
        trainer.kill()
