"""Zephon's per-flush packing warnings are counted and reported once (zephon_loader.zephon_logs).

Real Zephon pipelines produce the records: an uncapped ``wrap`` logs
"PackSequences wrap: dropping N trailing token(s) ..." at every flush, and
``first_fit`` logs "PackSequences first_fit: dropped N document(s) ..." at the
end of each pass. Before, each of them went to stderr on its own line (through
any progress bar); they now arrive as totals, once, under ``zephon_loader``.
"""

from __future__ import annotations

import logging

import pytest
import zephon
from zephon.work import MixtureSpec, StaticMixtureWorkSource

from zephon_loader.zephon_logs import ZEPHON_PACK_LOGGER, ZephonLogSummary, summarize_zephon_logs

ROW = 16


def _lengths(algorithm: str) -> list[int]:
    # wrap: short records, so every flush leaves a partial row; first_fit: some records longer than a row
    return [3 + (i % 7) * (1 if algorithm == "wrap" else 5) for i in range(60)]


def _pipeline(algorithm: str):
    rows = [{"ids": list(range(1, 1 + n))} for n in _lengths(algorithm)]
    dataset = zephon.Dataset.from_dict("mem", {0: zephon.InMemoryShard(rows)})
    work = StaticMixtureWorkSource(datasets=[dataset], mixture=MixtureSpec({"mem": 1.0}), seed=0, chunk_size=10)
    extra = {} if algorithm == "wrap" else {"num_bins": 4}
    return zephon.Pipeline(work).pack_flat(ROW, algorithm=algorithm, tokens_field="ids", pad_token_id=0, **extra).batch(2)


def _delivered_tokens(pipeline) -> int:
    """Real tokens Zephon packed into rows (its own per-row provenance, as ``loader.stats()`` counts them)."""
    return sum(sum((record.meta.component_token_counts or {}).values()) for batch in pipeline for record in batch.records)


@pytest.mark.parametrize("algorithm", ["wrap", "first_fit"])
def test_real_zephon_notices_are_counted_not_printed(algorithm, capfd, caplog):
    passes = 3
    with caplog.at_level(logging.WARNING, logger="zephon_loader"):
        with summarize_zephon_logs() as notices:
            delivered = sum(_delivered_tokens(_pipeline(algorithm)) for _ in range(passes))
    assert "PackSequences" not in capfd.readouterr().err  # none of Zephon's own lines reached stderr
    totals = notices.totals()
    offered = passes * sum(_lengths(algorithm))
    if algorithm == "wrap":
        entry = totals["wrap_trailing_tokens_dropped"]
        assert entry["log_records"] == passes  # one flush per pass here
        assert entry["max_length"] == ROW and entry["tombstones"] >= entry["packing_groups"] >= passes
    else:
        entry = totals["first_fit_longer_than_row"]
        assert entry["documents"] == passes * sum(n > ROW for n in _lengths(algorithm))
        assert entry["max_length"] == ROW
    assert entry["tokens"] == offered - delivered  # exactly what Zephon did not deliver
    summary = [r for r in caplog.records if r.name == "zephon_loader"]
    assert [r.getMessage() for r in summary] == notices.lines() and len(summary) == 1  # once, at the end


def test_other_records_pass_and_unknown_shapes_are_not_swallowed(caplog):
    logger = logging.getLogger(ZEPHON_PACK_LOGGER)
    with caplog.at_level(logging.DEBUG, logger=ZEPHON_PACK_LOGGER):
        with summarize_zephon_logs(report=False) as notices:
            logger.warning("PackSequences: something else happened (%d)", 1)
            logger.warning("PackSequences wrap: dropping %s trailing token(s) in a new format", "many")
            logger.debug("PackSequences wrap: dropping %s trailing token(s) across %d packing group(s) in %d lane(s) "
                         "that did not fill a full max_length=%d bin; emitted %d tombstone(s) to close contributor "
                         "offsets.", 5, 1, 1, 16, 1)  # Zephon's early-close variant: not data loss, not counted
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "PackSequences: something else happened (1)",
        "PackSequences wrap: dropping many trailing token(s) in a new format",
        "PackSequences wrap: dropping 5 trailing token(s) across 1 packing group(s) in 1 lane(s) that did not "
        "fill a full max_length=16 bin; emitted 1 tombstone(s) to close contributor offsets.",
    ]
    assert notices.totals() == {} and notices.lines() == []
    assert not logger.filters  # removed on exit


def test_summary_is_thread_safe_totals():
    import threading

    summary = ZephonLogSummary()
    record = logging.LogRecord(
        ZEPHON_PACK_LOGGER, logging.WARNING, __file__, 1,
        "PackSequences %s: dropped %d document(s) (%d token(s)) longer than max_length=%d; ...",
        ("best_fit", 2, 50, 16), None,
    )
    threads = [threading.Thread(target=lambda: [summary.filter(record) for _ in range(500)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert summary.totals() == {"best_fit_longer_than_row": {
        "log_records": 2000, "documents": 4000, "tokens": 100_000, "max_length": 16}}


def test_a_mid_window_state_says_what_a_resume_guarantees():
    """Zephon's "will permute the remainder" reads as "my data order changes": the loader explains it, once."""
    import warnings

    import yaml

    from zephon_loader import build_text_loader, zephon_compat
    from zephon_loader.config import default_config_path

    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.update(base_dir=str(default_config_path().parent), read_ahead=0, distributed={"canonical_replicas": 2},
                runtime={"runner": "threads"})
    zephon_compat._explained.clear()
    with build_text_loader(node) as loader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        next(it)
        loader.state_dict()
        loader.state_dict()
    texts = [str(w.message) for w in caught]
    assert not any(text.startswith("[zephon] Checkpoint taken mid-window") for text in texts)
    ours = [text for text in texts if text.startswith("zephon_loader: this state was taken inside a Zephon window")]
    assert len(ours) == 1 and "same data-parallel size is exact" in ours[0]
