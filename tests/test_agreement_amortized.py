"""The pass agreement amortized (issue 38, part 3): one collective per several batches, ranks in step as before.

Four gloo ranks on loopback, three epochs of the loop users write (one
``all_reduce`` per batch, pairing the same epoch on every rank). Each rank runs
it twice per ``read_ahead`` (0: inline, 2: a background thread): with the
agreement's window at 1 (a rank promises one batch: one blocking exchange per
batch, the agreement as it was) and at its default (a rank promises the
batches it holds read ahead, up to ``PassAgreement.WINDOW``). The two runs
yield the same batches per epoch on every rank, and their states at each
epoch's end resume the next epoch exactly (the same carry first); the
amortized one runs a fraction of the collectives: counted by the agreement
and, independently, by wrapping
``torch.distributed.all_reduce`` (the loop's own calls subtracted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from spawned_ranks import error_file, free_port, run_ranks

pytestmark = pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch.distributed")

WORLD = 4
EPOCHS = 3
#: Fails a run whose ranks are not done by then (a hang): far above what they need on a busy 2-core machine.
BOUND_S = 600.0



def _config(sources, tokenizer_dir: str, read_ahead: int, run_id: str) -> dict:
    return {
        "sources": sources,
        "tokenizer": {"path": tokenizer_dir},
        "sequence_length": 16,
        "micro_batch_size": 1,
        "packing": {"algorithm": "wrap"},
        "seed": 11,
        "read_ahead": read_ahead,
        "runtime": {"runner": "threads"},
        "distributed": {"run_id": run_id},
    }


def _rank(rank: int, port: int, task: dict) -> None:
    out = Path(task["out"]) / f"rank{rank}.json"
    with error_file(out.with_suffix(".error")):
        import torch
        import torch.distributed as dist

        from zephon_loader.build import build_text_loader
        from zephon_loader.nodes.agreement import PassAgreement

        calls = [0]
        all_reduce = dist.all_reduce

        def counted(*args, **kwargs):
            calls[0] += 1
            return all_reduce(*args, **kwargs)

        dist.all_reduce = counted  # the agreement looks it up at each call
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        default_window = PassAgreement.WINDOW
        results = {}
        for read_ahead in (0, 2):
            for window in (1, default_window):
                PassAgreement.WINDOW = window
                epochs, states, loop_calls = [], [], 0
                calls[0] = 0
                with build_text_loader(_config(task["sources"], task["tokenizer"], read_ahead,
                                               f"w{window}-r{read_ahead}")) as loader:
                    for epoch in range(EPOCHS):
                        rows = []
                        for batch in loader:
                            seen = torch.tensor([epoch, -epoch])
                            dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # pairs the same step on every rank
                            loop_calls += 1
                            assert seen.tolist() == [epoch, -epoch], f"rank {rank} paired epoch {epoch} with another"
                            rows += batch["input_ids"].tolist()
                        epochs.append(rows)
                        states.append(loader.state_dict())
                    counted_by_agreement = loader._agreement.collectives
                wrapped = calls[0] - loop_calls
                # Each epoch's end state resumes the next epoch (what was carried first), read by the same loop.
                resumed = []
                for state in states[:-1] if window > 1 else []:  # window 1: tests/test_even_passes.py
                    with build_text_loader(_config(task["sources"], task["tokenizer"], read_ahead,
                                                   f"resume-w{window}-r{read_ahead}-{len(resumed)}")) as loader:
                        loader.load_state_dict(json.loads(json.dumps(state)))
                        rows = []
                        for batch in loader:
                            seen = torch.tensor([len(resumed), -len(resumed)])
                            dist.all_reduce(seen, op=dist.ReduceOp.MIN)
                            rows += batch["input_ids"].tolist()
                        resumed.append(rows)
                results[f"{read_ahead}/{window}"] = {
                    "epochs": epochs, "resumed": resumed, "agreement": counted_by_agreement, "wrapped": wrapped,
                    "batches": loop_calls, "ended": [[s["epoch"], s["pass_ended"], len(s["carry"])] for s in states],
                    "states": states}
                dist.barrier()
        PassAgreement.WINDOW = default_window
        dist.destroy_process_group()
        out.write_text(json.dumps({"window": default_window, "runs": results}))


def test_amortized_agreement_keeps_the_ranks_in_step_with_fewer_collectives(tmp_path, jsonl_sources, tokenizer_dir):
    sources = [{"name": name, "path": str(path), "weight": 1.0} for name, path in sorted(jsonl_sources.items())]
    task = {"sources": sources, "tokenizer": str(tokenizer_dir), "out": str(tmp_path)}
    port = free_port()
    run_ranks(_rank, [(rank, port, task) for rank in range(WORLD)],
              [tmp_path / f"rank{rank}.error" for rank in range(WORLD)], bound_s=BOUND_S, what="amortized agreement")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    window = ranks[0]["window"]
    assert window >= 4, f"PassAgreement.WINDOW is {window}: not several batches per exchange"
    for read_ahead in (0, 2):
        per_batch = [r["runs"][f"{read_ahead}/1"] for r in ranks]
        amortized = [r["runs"][f"{read_ahead}/{window}"] for r in ranks]
        for rank in range(WORLD):
            # The same batches per epoch as one exchange per batch, and states that resume the same next epochs
            # (the same carry; a state may be cut at another read-ahead anchor: the same position in other words).
            assert amortized[rank]["epochs"] == per_batch[rank]["epochs"], f"read_ahead={read_ahead}, rank {rank}"
            assert amortized[rank]["ended"] == per_batch[rank]["ended"], f"read_ahead={read_ahead}, rank {rank}"
            assert amortized[rank]["resumed"] == amortized[rank]["epochs"][1:], f"read_ahead={read_ahead}, rank {rank}"
            assert all(r["runs"][f"{read_ahead}/{window}"]["states"] == amortized[0]["states"] for r in ranks)
            for run in (per_batch[rank], amortized[rank]):  # the agreement counts what it ran
                assert run["agreement"] == run["wrapped"], (read_ahead, rank, run["agreement"], run["wrapped"])
        for epoch in range(EPOCHS):  # in step: the same count on every rank
            assert len({len(run["epochs"][epoch]) for run in amortized}) == 1, (read_ahead, epoch)
        assert any(state["carry"] for state in amortized[0]["states"][:-1]), "nothing was carried: proves nothing"
        batches = amortized[0]["batches"]
        assert batches >= 20 * EPOCHS, f"{batches} batches in {EPOCHS} epochs: too few to tell"
        # One exchange per batch (and one more at each pass end) with the window at 1.
        assert per_batch[0]["agreement"] == batches + EPOCHS, (read_ahead, per_batch[0]["agreement"], batches)
        rate = amortized[0]["agreement"] / batches
        print(f"read_ahead={read_ahead}: {batches} batches per rank in {EPOCHS} epochs "
              f"{[len(e) for e in amortized[0]['epochs']]}: {per_batch[0]['agreement']} collectives with the window "
              f"at 1, {amortized[0]['agreement']} at {window} ({rate:.3f} a batch)")
        # Inline, a rank pulls a window at each exchange: one exchange per WINDOW - LEAD batches, plus the pass
        # ends. With a background thread the promise is what the thread read ahead by then: fewer than one per
        # batch whatever the machine's speed (bounded loosely: a busy machine's reader may hold only 1-2).
        bound = 1.0 / (window - 2) + 3 * EPOCHS / batches if read_ahead == 0 else 0.75
        assert rate <= bound, f"read_ahead={read_ahead}: {amortized[0]['agreement']} collectives for {batches} batches"
