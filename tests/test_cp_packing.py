"""Context-parallel packing (``contract.cp_size > 1``, issue 40 item 2) against TE's THD + CP contract.

Every document is padded before packing to a multiple of ``2 * cp_size`` (so Zephon's packer gives the
padding room: a padded document that no longer fits the open row goes to another row; none is cut). Checked
on every demo batch at cp_size 2 and 4:

* the layout: rows of ``S``; ``seq_lens_padded`` multiples of ``2 * cp_size`` summing to ``S``,
  ``cu_seqlens_padded`` their running sum, ``seq_lens`` / the metadata's ``cu_seqlens`` the real tokens;
* labels and positions: each document's real tokens are a whole ``BOS ... EOS`` document with positions
  ``0 .. n - 1`` and next-token labels (the last one ``-100``), its padding ``-100``;
* the split: a pure-torch ``get_batch_on_this_cp_rank`` / ``thd_get_partitioned_indices`` reference (rank
  ``r`` takes chunks ``r`` and ``2 * cp - 1 - r`` of every padded document) gives each rank the positions of
  exactly those chunks, and AutoModel 0.7.0's ``make_cp_batch_for_te`` (TE's index function replaced by the
  reference) gives each rank the same tokens;
* attention: ``preprocess_args_and_kwargs_for_attn(..., "te")`` with the batch's offsets on the CPU fake of
  TE equals per-document attention over the real tokens alone;
* ``stats()["cp_padding_tokens"]`` is the padding the batches hold.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import yaml

from fake_kernels import fake_te
from zephon_loader import build_text_loader
from zephon_loader import fields as F
from zephon_loader.backends import initialize_attn_module_and_func, preprocess_args_and_kwargs_for_attn
from zephon_loader.config import default_config_path
from zephon_loader.contract import PackingContract
from zephon_loader.pipeline.records import CheckTokens


def _node(cp_size, **overrides):
    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.pop("_target_", None)
    node.update(base_dir=str(default_config_path().parent), runtime={"runner": "threads"},
                packing={"algorithm": "best_fit"},
                contract={"attn_implementation": "te", "qkv_format": "thd", "packed_mask_type": "document_ids",
                          "cp_size": cp_size})
    node.update(overrides)
    return node


@pytest.fixture(scope="module", params=[2, 4])
def cp_run(request):
    with build_text_loader(_node(request.param)) as loader:
        batches = list(loader)
        stats = loader.stats()
    return request.param, batches, stats, None


def _flat_layout(batch):
    """AutoModel's ``process_input_for_thd`` view: per document (row-major) its real and padded length."""
    keep = batch[F.SEQ_LENS_PADDED] != F.THD_SENTINEL
    return batch[F.SEQ_LENS][keep], batch[F.SEQ_LENS_PADDED][keep]


def reference_partition(cu_seqlens_padded, cp_size, rank):
    """TE's ``thd_get_partitioned_indices`` in pure torch: chunks ``rank`` and ``2 * cp - 1 - rank`` of each sequence."""
    parts = []
    for start, end in zip(cu_seqlens_padded[:-1].tolist(), cu_seqlens_padded[1:].tolist()):
        chunk = (end - start) // (2 * cp_size)
        assert chunk * 2 * cp_size == end - start, "a padded sequence is not a multiple of 2 * cp_size"
        for piece in (rank, 2 * cp_size - 1 - rank):
            parts.append(torch.arange(start + piece * chunk, start + (piece + 1) * chunk))
    return torch.cat(parts)


def test_layout_labels_and_positions(cp_run):
    cp_size, batches, _stats, _ = cp_run
    multiple = 2 * cp_size
    sequence_length = batches[0][F.INPUT_IDS].shape[1]
    assert len(batches) > 50
    documents = 0
    for index, batch in enumerate(batches):
        assert batch[F.INPUT_IDS].shape[1] == sequence_length
        seq_lens, seq_lens_padded, cu_padded = batch[F.SEQ_LENS], batch[F.SEQ_LENS_PADDED], batch[F.CU_SEQLENS_PADDED]
        used = seq_lens_padded != F.THD_SENTINEL
        assert torch.equal(used, seq_lens != F.THD_SENTINEL)
        assert bool((seq_lens_padded[used] % multiple == 0).all()), index
        assert bool((seq_lens[used] <= seq_lens_padded[used]).all()), index
        assert torch.equal(seq_lens_padded.masked_fill(~used, 0).sum(dim=1), torch.full_like(seq_lens[:, 0], sequence_length))
        assert cu_padded.dtype == torch.int32 and cu_padded.shape == (used.shape[0], used.shape[1] + 1)
        for row in range(used.shape[0]):
            n = int(used[row].sum())
            lengths, padded = seq_lens[row, :n].tolist(), seq_lens_padded[row, :n].tolist()
            offsets = cu_padded[row].tolist()
            assert offsets[: n + 1] == [0] + torch.tensor(padded).cumsum(0).tolist() and set(offsets[n + 1:]) <= {-1}
            real_cu = batch[F.CU_SEQLENS][row].tolist()
            if sum(lengths):
                assert real_cu[: n + 1] == [0] + torch.tensor(lengths).cumsum(0).tolist(), (index, row)
            tokens, labels = batch[F.INPUT_IDS][row].tolist(), batch[F.LABELS][row].tolist()
            positions = batch[F.POSITION_IDS][row].tolist()
            for start, length, span in zip(offsets, lengths, padded):
                if length == 0:
                    continue
                documents += 1
                real = tokens[start:start + length]
                assert positions[start:start + length] == list(range(length)), (index, row)
                assert labels[start:start + length] == real[1:] + [-100], (index, row)
                is_last = start + span == sequence_length
                pad_end = start + span if not is_last else start + length + (-length % multiple)
                assert labels[start + length:start + span] == [-100] * (span - length)
                # A document's padding continues its positions (the rest of the last span is the row's padding).
                assert positions[start + length:pad_end] == list(range(length, pad_end - start)), (index, row)
                assert not bool(batch[F.PADDING_MASK][row, start:pad_end].any())
    assert documents > 100


def test_cp_split_equals_te_reference_and_automodel(cp_run, monkeypatch):
    cp_size, batches, _stats, _ = cp_run
    automodel_utils = pytest.importorskip("nemo_automodel.components.distributed.context_parallel.utils")
    # AutoModel imports TE's index function inside its shard step: give it the pure-torch reference.
    tex = types.ModuleType("transformer_engine_torch")
    tex.thd_get_partitioned_indices = lambda cu, total, world, rank: reference_partition(cu, world, rank)
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", tex)
    rank_holder = {"rank": 0}
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank_holder["rank"])
    mesh = types.SimpleNamespace(size=lambda: cp_size, get_group=lambda: None)
    for index, batch in enumerate(batches[:40]):
        lengths, padded = _flat_layout(batch)
        cu_padded = torch.nn.functional.pad(padded.cumsum(0), (1, 0))
        flat_ids, flat_positions = batch[F.INPUT_IDS].flatten(), batch[F.POSITION_IDS].flatten()
        seen = []
        for rank in range(cp_size):
            indices = reference_partition(cu_padded, cp_size, rank)
            assert indices.numel() * cp_size == flat_ids.numel()
            # Each rank holds, of every padded document, the positions of its two chunks.
            expected = []
            for span in padded.tolist():
                chunk = span // (2 * cp_size)
                for piece in (rank, 2 * cp_size - 1 - rank):
                    expected += list(range(piece * chunk, (piece + 1) * chunk))
            got = flat_positions[indices].tolist()
            # The row's own trailing padding (inside the last span) is numbered from 0 by Zephon: compare
            # document slots only.
            inside = torch.cat([torch.arange(p) < length + (-length % (2 * cp_size))
                                for length, p in zip(lengths.tolist(), padded.tolist())])[indices]
            assert [g for g, keep in zip(got, inside.tolist()) if keep] == \
                   [e for e, keep in zip(expected, inside.tolist()) if keep], (index, rank)
            rank_holder["rank"] = rank
            shard = automodel_utils.make_cp_batch_for_te(
                mesh, {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
                       if k in (F.INPUT_IDS, F.LABELS, F.POSITION_IDS, F.SEQ_LENS, F.SEQ_LENS_PADDED)})
            assert torch.equal(shard[F.INPUT_IDS], flat_ids[indices]), (index, rank)
            assert torch.equal(shard[F.LABELS], batch[F.LABELS].flatten()[indices]), (index, rank)
            seen.append(indices)
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(flat_ids.numel()))


def test_te_attention_over_the_padded_layout_equals_per_document_attention(cp_run):
    cp_size, batches, _stats, _ = cp_run
    heads, dim = 2, 8
    generator = torch.Generator().manual_seed(cp_size)
    for batch in batches[:6]:
        lengths, padded = _flat_layout(batch)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        cu_padded = torch.nn.functional.pad(padded.cumsum(0), (1, 0)).to(torch.int32)
        tokens = batch[F.INPUT_IDS].numel()
        q, k, v = (torch.randn(tokens, heads, dim, generator=generator, dtype=torch.float64) for _ in range(3))
        with fake_te() as te:
            _module, func = initialize_attn_module_and_func("te", heads, dim, dim, dim**-0.5, qkv_format="thd")
            q2, k2, v2, kwargs = preprocess_args_and_kwargs_for_attn(
                q, k, v, None, "te", cu_seqlens=cu, cu_seqlens_padded=cu_padded, max_seqlen=int(lengths.max()))
            out = func(q2, k2, v2, **kwargs).reshape(tokens, heads, dim)
        assert kwargs["pad_between_seqs"] is True
        assert te.instances[0].calls[0]["pads_between_seqs"] is True
        for start, length in zip(cu_padded[:-1].tolist(), lengths.tolist()):
            if length == 0:
                continue
            rows = slice(start, start + length)
            scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * dim**-0.5
            scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
            expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[rows])
            torch.testing.assert_close(out[rows], expected)
        real = torch.zeros(tokens, dtype=torch.bool)
        for start, length in zip(cu_padded[:-1].tolist(), lengths.tolist()):
            real[start:start + length] = True
        assert bool((out[~real] == 0).all())  # padding rows: zeros, attended by nothing


def test_padding_is_counted_in_stats(cp_run):
    cp_size, batches, stats, _ = cp_run
    in_batches = 0
    for batch in batches:
        lengths, padded = _flat_layout(batch)
        trailing = batch[F.PADDING_MASK].sum()
        in_batches += int(padded.sum() - lengths.sum() - trailing)
    assert stats["cp_padding_tokens"] == in_batches > 0


def test_check_tokens_pads_each_record_before_packing():
    check = CheckTokens(tokens_field="input_ids", vocab_size=100, max_record_tokens=None, row_capacity=8,
                        cp_multiple=4, pad_token_id=7, shards=None, policy="skip", log=None)
    out, problem = check.process({"input_ids": [1, 2, 3, 4, 5]}, (0, 0, 0))
    assert problem is None
    assert out["input_ids"].tolist() == [1, 2, 3, 4, 5, 7, 7, 7]
    assert out[F.CP_PADDING].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    out, _ = check.process({"input_ids": [1, 2, 3, 4]}, (0, 0, 1))
    assert out[F.CP_PADDING].tolist() == [0, 0, 0, 0]
    _out, problem = check.process({"input_ids": list(range(9))}, (0, 0, 2))
    assert problem[0] == "longer_than_row" and "cp_size" in problem[-1]


def test_cp_contract_and_config_refusals():
    with pytest.raises(ValueError, match="packing_contract.cp_size: got 2 with qkv_format 'bshd'"):
        PackingContract("document_ids", cp_size=2)
    with pytest.raises(ValueError, match="packing_contract.cp_size: got 0"):
        PackingContract("document_ids", qkv_format="thd", cp_size=0)
    assert PackingContract("document_ids", qkv_format="thd", cp_size=4).cp_padding == 8
    for overrides, match in (
        ({"packing": {"algorithm": "wrap"}}, "packing.algorithm 'wrap', expected first_fit or best_fit"),
        ({"sequence_length": 250}, "sequence_length 250, expected a sequence_length that is a multiple of"),
        ({"xdoc": True}, "xdoc: true, expected xdoc: false"),
    ):
        with pytest.raises(ValueError, match=match):
            build_text_loader(_node(2, **overrides))


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_a_cp_run_resumes_exactly_and_refuses_a_state_of_another_cp_size(cp_run, read_ahead):
    """A state taken k batches into a cp_size run resumes at batch k + 1 (the padded layout included); a loader
    with another cp_size refuses it, naming the contract (its rows are laid out differently)."""
    cp_size, batches, _, _ = cp_run
    with build_text_loader(_node(cp_size, read_ahead=read_ahead)) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = loader.state_dict()
    with build_text_loader(_node(cp_size, read_ahead=read_ahead)) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert len(rest) == len(batches) - 5
    for got, want in zip(rest, batches[5:]):
        for name in (F.INPUT_IDS, F.LABELS, F.POSITION_IDS, F.SEQ_LENS_PADDED, F.SEQ_LENS):
            assert torch.equal(got[name], want[name]), name
    other = 4 if cp_size == 2 else 2
    with build_text_loader(_node(other)) as loader, pytest.raises(ValueError, match=rf"contract\.cp_size: saved {cp_size}, now {other}"):
        loader.load_state_dict(state)
