"""Stock Hugging Face models on yielded batches (issue 10 item 3): the ``hf`` contract.

Unmodified transformers models (tiny random Llama, GPT-2 and Qwen2 built from
local configs, float32) are fed ``model(**batch)`` with batches the loader
yields under ``contract: {attn_implementation: hf}``. transformers derives the
packed block-causal mask from ``position_ids`` itself
(``masking_utils.find_packed_sequence_indices``) when no ``attention_mask`` is
passed and no KV cache is in use. Each document's logits must equal the
document run alone, for the ``sdpa`` and ``eager`` kernels, in training and
evaluation mode; the model's own loss must equal the per-document loss.
transformers' flash kernels cannot run here (no CUDA); the varlen kwargs the
batch carries for them are checked against transformers' own derivation from
positions.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import find_packed_sequence_indices  # noqa: E402
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids  # noqa: E402

from conftest import collect  # noqa: E402
from zephon_loader import fields as F  # noqa: E402
from zephon_loader.build import build_text_loader  # noqa: E402

SEQUENCE_LENGTH, MICRO_BATCH = 48, 3
ATOL = 1e-5
BATCHES = 3


@pytest.fixture(scope="module")
def vocab_size(tokenizer):
    return len(tokenizer)


def loader_config(jsonl_sources, tokenizer_dir, **overrides):
    config = {
        "sources": [{"name": name, "path": str(path), "weight": 1.0} for name, path in sorted(jsonl_sources.items())],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": SEQUENCE_LENGTH,
        "micro_batch_size": MICRO_BATCH,
        "seed": 3,
        "runtime": {"runner": "threads"},
        "contract": {"attn_implementation": "hf"},
    }
    config.update(overrides)
    return config


def yielded(config, limit=BATCHES):
    with build_text_loader(config) as loader:
        return collect(loader, limit)


@pytest.fixture(scope="module")
def hf_batches(jsonl_sources, tokenizer_dir):
    return yielded(loader_config(jsonl_sources, tokenizer_dir))


@pytest.fixture(scope="module")
def hf_xdoc_batches(jsonl_sources, tokenizer_dir):
    return yielded(loader_config(jsonl_sources, tokenizer_dir, xdoc=True))


def tiny_model(kind: str, vocab_size: int, attn_implementation: str) -> torch.nn.Module:
    """A tiny random model of ``kind``, dropout off (so training mode is deterministic)."""
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common,
        )
        model_class = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common,
        )
        model_class = transformers.Qwen2ForCausalLM
    else:
        config = transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **common,
        )
        model_class = transformers.GPT2LMHeadModel
    config._attn_implementation = attn_implementation
    model = model_class(config)
    assert model.config._attn_implementation == attn_implementation
    return model


def documents(batch):
    """``(row, start, end)`` of every document, from the docs/contract.md §4 rule (independent of the loader's ids).

    A document starts at column 0 and wherever the position is 0; padding ends the row.
    """
    out = []
    positions, padding = batch[F.POSITION_IDS], batch[F.PADDING_MASK]
    for b in range(positions.shape[0]):
        real = int((~padding[b]).sum())
        starts = [s for s in range(real) if s == 0 or int(positions[b, s]) == 0]
        out += [(b, start, end) for start, end in zip(starts, starts[1:] + [real])]
    return out


def alone(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, vocab]`` of ``tokens`` run alone (positions 0..n-1, no cache)."""
    with torch.no_grad():
        return model(input_ids=tokens[None], use_cache=False).logits[0]


def test_hf_contract_batches_carry_no_mask(hf_batches):
    assert hf_batches
    for batch in hf_batches:
        assert F.ATTENTION_MASK not in batch
        for name in (F.PACKED_TOKEN_INDICES, F.CU_SEQLENS, F.SEQ_LENS):
            assert name not in batch, name
        assert batch[F.USE_CACHE] is False
        assert batch[F.SHIFT_LABELS] is batch[F.LABELS]  # the same tensor, already next-token targets
        padding = batch[F.PADDING_MASK]
        assert bool((batch[F.LABELS][padding] == F.IGNORE_INDEX).all())
    assert any(bool(batch[F.PADDING_MASK].any()) for batch in hf_batches), "expected rows with trailing padding"
    assert any(len(documents(batch)) > MICRO_BATCH for batch in hf_batches), "expected rows with several documents"


@pytest.mark.parametrize("xdoc", [False, True])
def test_flash_kwargs_are_what_transformers_derives_from_positions(hf_batches, hf_xdoc_batches, xdoc):
    """transformers' flash path reads packing from position_ids only for one flattened row (batch size 1); the
    batch carries the varlen kwargs over the flattened [B * S] layout, equal to transformers' own derivation
    from the flattened positions (prepare_fa_kwargs_from_position_ids)."""
    for batch in hf_xdoc_batches if xdoc else hf_batches:
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch[F.POSITION_IDS])
        assert batch[F.CU_SEQ_LENS_Q].dtype == torch.int32
        assert torch.equal(batch[F.CU_SEQ_LENS_Q], cu_q) and torch.equal(batch[F.CU_SEQ_LENS_K], cu_k)
        assert batch[F.MAX_LENGTH_Q] == batch[F.MAX_LENGTH_K] == int(max_q) == int(max_k)


def test_transformers_segments_are_the_documents(hf_batches):
    """find_packed_sequence_indices on the yielded positions: one sequence per document, the pad tail its own."""
    for batch in hf_batches:
        segments = find_packed_sequence_indices(batch[F.POSITION_IDS])
        assert segments is not None
        padding = batch[F.PADDING_MASK]
        for b in range(padding.shape[0]):
            expected, seen = [], 0
            for row, start, end in documents(batch):
                if row == b:
                    expected += [seen] * (end - start)
                    seen += 1
            real = len(expected)
            assert segments[b, :real].tolist() == [s + int(segments[b, 0]) for s in expected]
            if real < padding.shape[1]:  # the pad tail restarts at 0: it never joins the last document
                tail = segments[b, real:]
                assert bool((tail == tail[0]).all()) and (real == 0 or int(tail[0]) == int(segments[b, real - 1]) + 1)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_each_document_equals_it_alone(hf_batches, vocab_size, kind, attn_implementation, mode):
    model = tiny_model(kind, vocab_size, attn_implementation)
    getattr(model, mode)()
    for batch in hf_batches:
        with torch.no_grad():
            out = model(**batch)  # the yielded dict as is: use_cache=False and shift_labels ride along
        losses, count = [], 0
        for b, start, end in documents(batch):
            reference = alone(model, batch[F.INPUT_IDS][b, start:end])
            torch.testing.assert_close(out.logits[b, start:end], reference, atol=ATOL, rtol=0)
            labels = batch[F.LABELS][b, start:end]
            losses.append(torch.nn.functional.cross_entropy(reference, labels, ignore_index=F.IGNORE_INDEX, reduction="sum"))
            count += int((labels != F.IGNORE_INDEX).sum())
        # The model's own loss: labels are already shifted, shift_labels keeps transformers from shifting again.
        torch.testing.assert_close(out.loss, torch.stack(losses).sum() / count, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_xdoc_row_equals_the_joined_row_alone(hf_xdoc_batches, vocab_size, kind):
    model = tiny_model(kind, vocab_size, "sdpa").eval()
    for batch in hf_xdoc_batches:
        padding = batch[F.PADDING_MASK]
        with torch.no_grad():
            logits = model(**batch).logits
        for b in range(padding.shape[0]):
            real = int((~padding[b]).sum())
            if real == 0:
                continue
            assert batch[F.POSITION_IDS][b, :real].tolist() == list(range(real))
            torch.testing.assert_close(logits[b, :real], alone(model, batch[F.INPUT_IDS][b, :real]), atol=ATOL, rtol=0)


def test_without_use_cache_false_documents_attend_across(hf_batches, vocab_size):
    """Why the batch carries ``use_cache=False``: transformers 5 (5.24 here) builds a KV cache whenever
    ``config.use_cache`` is on, in training mode too, and with a cache it never derives the packed mask.
    (If this ever fails, transformers derives it in training mode as well and the README caveat can go.)
    """
    model = tiny_model("llama", vocab_size, "sdpa").train()
    assert model.config.use_cache
    batch = {name: value for name, value in hf_batches[0].items() if name != F.USE_CACHE}
    with torch.no_grad():
        logits = model(**batch).logits
    later = [(b, s, e) for b, s, e in documents(batch) if s > 0]
    assert later
    differs = [not torch.allclose(logits[b, s:e], alone(model, batch[F.INPUT_IDS][b, s:e]), atol=ATOL) for b, s, e in later]
    assert all(differs)


def test_document_ids_mask_is_not_for_stock_models(jsonl_sources, tokenizer_dir, vocab_size):
    """The old README pairing: the ``fa4`` contract's ``[B, S]`` document ids given to a stock HF model are read
    as a padding mask, so later documents attend to earlier ones. The ``hf`` contract exists for these models."""
    batch = yielded(loader_config(jsonl_sources, tokenizer_dir, contract={"attn_implementation": "fa4"}), 1)[0]
    assert batch[F.ATTENTION_MASK].dtype == torch.int64 and int(batch[F.ATTENTION_MASK].max()) > 1
    model = tiny_model("llama", vocab_size, "sdpa").eval()
    inputs = {name: batch[name] for name in (F.INPUT_IDS, F.POSITION_IDS, F.ATTENTION_MASK)}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    later = [(b, s, e) for b, s, e in documents(batch) if s > 0]
    assert later
    assert not all(
        torch.allclose(logits[b, s:e], alone(model, batch[F.INPUT_IDS][b, s:e]), atol=ATOL) for b, s, e in later
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"return_packed_sequence_metadata": True}, r"return_packed_sequence_metadata: got True with packed_mask_type 'position_ids'"),
        ({"contract": {"attn_implementation": "hf", "requires_packed_sequence_metadata": True}}, "never reads the gathered-token bundle"),
        ({"contract": {"attn_implementation": "hf", "packed_mask_type": "document_ids"}}, r"packed_mask_type: got 'document_ids' with attn_implementation 'hf'"),
    ],
)
def test_hf_contract_refuses_what_it_cannot_serve(jsonl_sources, tokenizer_dir, overrides, match):
    with pytest.raises(ValueError, match=match):
        build_text_loader(loader_config(jsonl_sources, tokenizer_dir, **overrides))


def test_hf_contract_refuses_eligibility(pretokenized_parquet_source):
    """Positions cannot exclude a token inside a document: eligibility is refused before anything starts."""
    config = {
        "sources": [{"name": "tok", "path": str(pretokenized_parquet_source)}],
        "tokenizer": {"pretokenized_field": "tokens"},
        "eligibility_field": "elig",
        "pad_token_id": 0,
        "sequence_length": SEQUENCE_LENGTH,
        "micro_batch_size": MICRO_BATCH,
        "runtime": {"runner": "threads"},
        "contract": {"attn_implementation": "hf"},
    }
    with pytest.raises(ValueError, match=r"'position_ids' \(attn_implementation 'hf'\).*eligibility field is configured"):
        build_text_loader(config)
    config["contract"] = {"attn_implementation": "sdpa", "packed_mask_type": "document_ids"}
    build_text_loader(config).close()  # the same data is servable by an AutoModel contract
