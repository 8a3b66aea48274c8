"""The AutoModel recipe slot (README, "AutoModel"): ``ZephonDataloaderConfig`` driven exactly as AutoModel 0.7.0 drives it.

The YAML goes through AutoModel's own ``ConfigNode`` / ``load_yaml_config`` and
``cfg.dataloader.instantiate()``; ``build`` is called with the keyword set the
recipe's ``materialize_loader`` uses (read from ``recipes/llm/train_ft.py``'s
source, which cannot be imported here), inside AutoModel's ``ScopedRNG``; the
contracts are AutoModel's ``DEFAULT_PACKED_SEQUENCE_CONTRACT`` and
``PackingCapabilities``; states go through ``torch.save`` and AutoModel's
restricted ``load_torch_ckpt`` like ``Checkpointer.save_on_dp_ranks`` /
``load_on_dp_ranks`` do.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import threading
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip(
    "nemo_automodel.components.config.loader",
    reason="nemo-automodel==0.7.0 is not importable: install it with `pip install --no-deps nemo-automodel==0.7.0`",
)
from nemo_automodel.components.checkpoint.checkpointing import load_torch_ckpt  # noqa: E402
from nemo_automodel.components.config.loader import ConfigNode, load_yaml_config  # noqa: E402
from nemo_automodel.components.datasets import packing as am_packing  # noqa: E402
from nemo_automodel.components.datasets.packing import DEFAULT_PACKED_SEQUENCE_CONTRACT  # noqa: E402
from nemo_automodel.components.models.common.packing import PackingCapabilities  # noqa: E402
from nemo_automodel.components.training.rng import ScopedRNG  # noqa: E402

from conftest import collect, train_tokenizer  # noqa: E402
from zephon_loader import ZephonDataloaderConfig, build_text_loader  # noqa: E402
from zephon_loader import stages as builders  # noqa: E402
from zephon_loader import fields as F  # noqa: E402
from zephon_loader.loader import ZephonLoader  # noqa: E402

pytestmark = pytest.mark.automodel

#: What ``materialize_loader`` in AutoModel 0.7.0's ``train_ft.py`` passes to ``config.build``.
RECIPE_KEYWORDS = {
    "dp_rank",
    "dp_world_size",
    "pp_enabled",
    "tokenizer",
    "dataset_build_context",
    "supports_seq_lens",
    "cp_size",
    "packing_contract",
    "collate_wrapper",
}
TARGET = "zephon_loader.ZephonDataloaderConfig"
FA4_MODEL = PackingCapabilities("document_ids", True, uses_native_fa4=True)
TE_THD = {"attn_implementation": "te", "packed_mask_type": "document_ids", "qkv_format": "thd"}


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def sources(jsonl_sources):
    return [{"name": name, "path": str(path), "weight": 1.0} for name, path in sorted(jsonl_sources.items())]


def recipe_yaml(sources, **overrides) -> dict:
    """A recipe YAML as a dict: a ``dataloader`` block with a ``_target_`` and no tokenizer path."""
    block = {
        "_target_": TARGET,
        "sources": sources,
        "sequence_length": 48,
        "micro_batch_size": 3,
        "seed": 7,
        "runtime": {"runner": "threads"},
    }
    block.update(overrides)
    return {"seed": 42, "model": {"pretrained_model_name_or_path": "unused"}, "dataloader": block}


def instantiate(sources, **overrides) -> ZephonDataloaderConfig:
    """What the recipe does with the YAML: ``ConfigNode(yaml).dataloader.instantiate()``."""
    return ConfigNode(recipe_yaml(sources, **overrides)).dataloader.instantiate()


def recipe_build(config, tokenizer, **overrides) -> ZephonLoader:
    """``materialize_loader`` of AutoModel 0.7.0's LLM recipe, single rank, no PP, no neat packing."""
    kwargs = {
        "tokenizer": tokenizer,
        "dataset_build_context": contextlib.nullcontext(),  # dataset_builds_on_all_ranks is True
        "dp_rank": 0,
        "dp_world_size": 1,
        "pp_enabled": False,
        "supports_seq_lens": True,
        "cp_size": 1,
        "packing_contract": DEFAULT_PACKED_SEQUENCE_CONTRACT,
        "collate_wrapper": None,
    }
    assert set(kwargs) == RECIPE_KEYWORDS
    kwargs.update(overrides)
    with ScopedRNG(seed=config.seed, ranked=True):
        return config.build(**kwargs)


def input_rows(batches) -> list[tuple[int, ...]]:
    return [
        tuple(row[~pad].tolist())
        for batch in batches
        for row, pad in zip(batch[F.INPUT_IDS], batch[F.PADDING_MASK])
    ]


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert set(a) == set(b), index
        for name in b:
            if isinstance(b[name], torch.Tensor):
                assert torch.equal(a[name], b[name]), (index, name)
            else:
                assert a[name] == b[name], (index, name)


class CountingContext:
    """A context manager that counts how often it is entered and exited, and knows whether it is active."""

    def __init__(self):
        self.entered = self.exited = 0

    @property
    def active(self) -> bool:
        return self.entered > self.exited

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        self.exited += 1
        return False


def _threads():
    return {t for t in threading.enumerate() if t.is_alive()}


def _train_ft_source() -> str:
    spec = importlib.util.find_spec("nemo_automodel")
    return (Path(spec.origin).parent / "recipes" / "llm" / "train_ft.py").read_text()


# ----------------------------------------------------------------------------- the protocol


def test_build_accepts_exactly_what_the_recipe_passes():
    """The keyword set is read from AutoModel's recipe source, so a change there fails here."""
    tree = ast.parse(_train_ft_source())
    (materialize,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "materialize_loader"]
    calls = [
        n for n in ast.walk(materialize)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "build"
    ]
    assert len(calls) == 1
    assert {kw.arg for kw in calls[0].keywords} == RECIPE_KEYWORDS
    read = {
        n.attr for n in ast.walk(materialize)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "config"
    }
    assert read == {"build", "seed", "dataset_builds_on_all_ranks"}

    parameters = inspect.signature(ZephonDataloaderConfig.build).parameters
    for name in RECIPE_KEYWORDS:
        assert name in parameters, name
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    required = {n for n, p in parameters.items() if n != "self" and p.default is inspect.Parameter.empty}
    assert required <= RECIPE_KEYWORDS


def test_yaml_file_through_automodel_config_loader(tmp_path, sources, tokenizer):
    """YAML text → AutoModel's ``load_yaml_config`` → ``cfg.dataloader.instantiate()`` → recipe build → batches."""
    text = f"""
seed: 42
dataloader:
  _target_: {TARGET}
  sources:
    - {{name: a, path: {sources[0]["path"]}, weight: 1.0}}
    - {{name: b, path: {sources[1]["path"]}, weight: 1.0}}
  sequence_length: 48
  micro_batch_size: 3
  packing:
    algorithm: wrap
  seed: 7
  shuffle: true
  runtime: {{runner: threads}}
"""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    cfg = load_yaml_config(path)
    dataloader = cfg.dataloader.instantiate()

    assert isinstance(dataloader, ZephonDataloaderConfig)
    assert dataloader.seed == 7 and isinstance(dataloader.seed, int)
    assert dataloader.dataset_builds_on_all_ranks is True
    assert dataloader.emits_thd is False
    assert dataloader.packing is not None and dataloader.packing.algorithm == "wrap"

    with recipe_build(dataloader, tokenizer) as loader:
        assert isinstance(loader, ZephonLoader)
        assert loader.fingerprint["seed"] == 7
        assert loader.fingerprint["packing"][0] == "wrap"
        batches = collect(loader)
    assert len(batches) >= 10
    for batch in batches:
        assert set(loader.yielded_fields) <= set(batch)
        assert batch[F.INPUT_IDS].shape == (3, 48) and batch[F.INPUT_IDS].dtype == torch.int64
        # AutoModel's default contract: block-causal 4D mask, no metadata.
        assert batch[F.ATTENTION_MASK].shape == (3, 1, 48, 48) and batch[F.ATTENTION_MASK].dtype == torch.bool
        assert F.PACKED_TOKEN_INDICES not in batch and F.SEQ_LENS not in batch

    # ConfigNode's value translation changed nothing: same stream as the plain-Python builder.
    reference = yaml.safe_load(text)["dataloader"]
    reference.pop("_target_")
    with build_text_loader(reference, tokenizer=tokenizer) as direct:
        assert_same_batches(batches, collect(direct))


@pytest.mark.parametrize(
    ("contract", "thd"),
    [(None, False), ({"attn_implementation": "fa4"}, False), ({"packed_mask_type": "flash_varlen"}, False), (TE_THD, True)],
)
def test_properties_the_recipe_reads(sources, contract, thd):
    extra = {} if contract is None else {"contract": contract}
    dataloader = instantiate(sources, seed=11, **extra)
    assert dataloader.seed == 11
    assert dataloader.dataset_builds_on_all_ranks is True
    assert dataloader.emits_thd is thd
    assert dataloader.packing is not None and dataloader.packing.algorithm == "first_fit"


# ----------------------------------------------------------------------------- packing_contract


def test_model_contract_changes_the_yielded_fields(sources, tokenizer):
    """No YAML contract: AutoModel's native-FA4 capabilities switch on document ids + metadata (AutoModel's own)."""
    dataloader = instantiate(sources)
    with recipe_build(dataloader, tokenizer) as loader:
        default = collect(loader, 4)
    with recipe_build(dataloader, tokenizer, packing_contract=FA4_MODEL) as loader:
        fa4 = collect(loader)
    with recipe_build(dataloader, tokenizer, packing_contract=PackingCapabilities("flash_varlen")) as loader:
        varlen = collect(loader, 4)

    for batch in default:
        assert batch[F.ATTENTION_MASK].ndim == 4
        assert not set(F.METADATA) & set(batch)
    assert fa4
    for batch in fa4:
        ids = batch[F.ATTENTION_MASK]
        assert ids.shape == (3, 48) and ids.dtype == torch.int64
        assert torch.equal(ids == 0, batch[F.PADDING_MASK])
        assert set(F.METADATA) <= set(batch)
        expected = am_packing.build_packed_sequence_metadata(ids)
        assert torch.equal(batch[F.PACKED_TOKEN_INDICES], expected["packed_token_indices"])
        assert torch.equal(batch[F.CU_SEQLENS], expected["cu_seqlens"])
        assert batch[F.MAX_SEQLEN] == expected["max_seqlen"]
    # Same tokens, only the attention representation differs.
    assert all(torch.equal(a[F.INPUT_IDS], b[F.INPUT_IDS]) for a, b in zip(default, fa4))
    for batch in varlen:
        assert F.ATTENTION_MASK not in batch
        assert int(batch[F.CU_SEQ_LENS_Q][-1]) == 3 * 48


def test_recipe_default_contract_does_not_override_the_yaml(sources, tokenizer):
    dataloader = instantiate(sources, contract={"attn_implementation": "fa4"})
    with recipe_build(dataloader, tokenizer, packing_contract=DEFAULT_PACKED_SEQUENCE_CONTRACT) as loader:
        batch = next(iter(loader))
    assert batch[F.ATTENTION_MASK].shape == (3, 48)
    assert set(F.METADATA) <= set(batch)


@pytest.mark.parametrize(
    "model_contract",
    [
        PackingCapabilities("flash_varlen"),
        PackingCapabilities("document_ids", False),
        PackingCapabilities("block_causal"),  # a model's own block-causal requirement, not the recipe default
    ],
    ids=["flash_varlen", "document_ids_no_metadata", "block_causal"],
)
def test_yaml_contract_disagreeing_with_the_model_raises_before_anything_starts(sources, tokenizer, model_contract):
    dataloader = instantiate(sources, contract={"attn_implementation": "fa4"})
    context = CountingContext()
    before = _threads()
    with pytest.raises(ValueError, match=r"dataloader\.contract"):
        recipe_build(dataloader, tokenizer, packing_contract=model_contract, dataset_build_context=context)
    assert context.entered == 0
    assert _threads() - before == set()


def test_yaml_contract_agreeing_with_the_model_is_served(sources, tokenizer):
    dataloader = instantiate(sources, contract={"attn_implementation": "fa4"})
    with recipe_build(dataloader, tokenizer, packing_contract=FA4_MODEL) as loader:
        batch = next(iter(loader))
    assert set(F.METADATA) <= set(batch)


# ----------------------------------------------------------------------------- tokenizer


def test_recipe_tokenizer_object_is_used_when_the_yaml_names_none(sources, tokenizer, tokenizer_dir, corpus_texts, tmp_path):
    from transformers import AutoTokenizer

    dataloader = instantiate(sources)
    assert dataloader.tokenizer.path is None
    with recipe_build(dataloader, tokenizer) as loader:
        recipe_batches = collect(loader, 6)

    # The YAML naming the same tokenizer folder gives the same stream ...
    with recipe_build(instantiate(sources, tokenizer={"path": str(tokenizer_dir)}), tokenizer=None) as loader:
        yaml_batches = collect(loader, 6)
    assert input_rows(recipe_batches) == input_rows(yaml_batches)

    # ... so does a tokenizer object whose name is a hub id, not a folder (it is saved, never resolved online).
    hub_named = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    hub_named.name_or_path = "some-org/some-model-that-does-not-exist"
    with recipe_build(dataloader, hub_named) as loader:
        assert input_rows(collect(loader, 6)) == input_rows(recipe_batches)

    # A different tokenizer object changes the tokens: the object really is what tokenizes.
    small_dir = train_tokenizer(corpus_texts, tmp_path / "small", vocab_size=300)
    small = AutoTokenizer.from_pretrained(str(small_dir), local_files_only=True)
    with recipe_build(dataloader, small) as loader:
        small_batches = collect(loader, 6)
    assert input_rows(small_batches) != input_rows(recipe_batches)
    assert max(int(b[F.INPUT_IDS].max()) for b in small_batches) < 300
    assert max(int(b[F.INPUT_IDS].max()) for b in recipe_batches) >= 300
    # Decoding with the object that was passed gives back corpus text.
    first = recipe_batches[0]
    text = tokenizer.decode(first[F.INPUT_IDS][0][~first[F.PADDING_MASK][0]].tolist(), skip_special_tokens=True)
    assert any(doc in text for doc in corpus_texts[:200] if len(doc) > 20)

    # No tokenizer anywhere: refused (never Zephon's silent hash stub).
    with pytest.raises(ValueError, match="tokenizer"):
        recipe_build(dataloader, None)


# ----------------------------------------------------------------------------- collate_wrapper


def test_collate_wrapper_is_applied_to_every_batch(sources, tokenizer):
    """A wrapper shaped like ``_build_pp_collate_wrapper``'s: ``wrapper(base_fn) -> fn(batch)``."""
    calls = {"wrap": 0, "batch": 0}
    seen_fields = []

    def wrapper(base_collate_fn):
        calls["wrap"] += 1

        def chained_collate_fn(batch, base_fn=base_collate_fn):
            out = base_fn(batch)
            seen_fields.append(set(out))
            calls["batch"] += 1
            out["causal_mask_mapping"] = {"full_attention": torch.zeros(1)}
            out["serial"] = calls["batch"]
            return out

        return chained_collate_fn

    dataloader = instantiate(sources, contract={"attn_implementation": "fa4"})
    with recipe_build(dataloader, tokenizer, collate_wrapper=wrapper) as loader:
        batches = collect(loader)
        fields = set(loader.yielded_fields)
    with recipe_build(dataloader, tokenizer) as loader:
        plain = collect(loader)

    assert calls["wrap"] == 1
    assert len(batches) == len(plain) > 5
    assert calls["batch"] == len(batches)
    assert [b["serial"] for b in batches] == list(range(1, len(batches) + 1))
    for batch, reference, seen in zip(batches, plain, seen_fields):
        assert "causal_mask_mapping" in batch
        assert fields <= seen  # the wrapper receives the finalized batch, AutoModel names
        assert torch.equal(batch[F.INPUT_IDS], reference[F.INPUT_IDS])
        assert torch.equal(batch[F.ATTENTION_MASK], reference[F.ATTENTION_MASK])


# ----------------------------------------------------------------------------- dataset_build_context


def test_dataset_build_context_is_entered_once_around_the_pipeline_build(sources, tokenizer, monkeypatch):
    context = CountingContext()
    built_inside = []
    real = builders.build_pipeline

    def spy(*args, **kwargs):
        built_inside.append(context.active)
        return real(*args, **kwargs)

    monkeypatch.setattr(builders, "build_pipeline", spy)
    with recipe_build(instantiate(sources), tokenizer, dataset_build_context=context) as loader:
        assert (context.entered, context.exited) == (1, 1)
        assert built_inside == [True]
        assert len(collect(loader, 3)) == 3
    assert (context.entered, context.exited) == (1, 1)


# ----------------------------------------------------------------------------- dp_rank / dp_world_size


def test_dp_world_size_above_one_without_aggregate_is_refused_before_workers(sources, tokenizer):
    dataloader = instantiate(sources)
    before = _threads()
    with pytest.raises(ValueError, match="aggregate_dir"):
        recipe_build(dataloader, tokenizer, dp_rank=1, dp_world_size=2)
    assert _threads() - before == set()
    with pytest.raises(ValueError, match="dp_rank"):
        recipe_build(dataloader, tokenizer, dp_rank=2, dp_world_size=2)


def test_dp_ranks_read_disjoint_lanes(sources, tokenizer, tmp_path):
    # Small chunks so each of the two lanes gets work (a chunk is Zephon's unit of DP distribution).
    common = {"chunk_size": 10, "distributed": {"aggregate_dir": str(tmp_path / "agg"), "run_id": "test"}}
    with recipe_build(instantiate(sources, chunk_size=10), tokenizer) as loader:
        single = input_rows(collect(loader))
    lanes = []
    for rank in (0, 1):
        with recipe_build(instantiate(sources, **common), tokenizer, dp_rank=rank, dp_world_size=2) as loader:
            lanes.append(input_rows(collect(loader)))
    assert lanes[0] and lanes[1]
    assert not set(lanes[0]) & set(lanes[1])
    assert abs(len(lanes[0]) + len(lanes[1]) - len(single)) <= 2 * 3  # each lane drops at most a partial batch


# ----------------------------------------------------------------------------- supports_seq_lens / cp_size / THD


def test_thd_contract_is_refused_without_seq_lens_support_or_with_context_parallel(sources, tokenizer):
    thd = instantiate(sources, contract=TE_THD)
    assert thd.emits_thd is True
    for overrides, match in (({"supports_seq_lens": False}, "supports_seq_lens"), ({"cp_size": 2}, "cp_size")):
        context = CountingContext()
        with pytest.raises(ValueError, match=match):
            recipe_build(thd, tokenizer, dataset_build_context=context, **overrides)
        assert context.entered == 0

    with recipe_build(thd, tokenizer) as loader:
        batch = next(iter(loader))
    assert batch[F.QKV_FORMAT] == "thd"
    assert batch[F.SEQ_LENS].dtype == torch.int64 and batch[F.SEQ_LENS].shape[0] == 3
    padded = torch.where(batch[F.SEQ_LENS_PADDED] == F.THD_SENTINEL, 0, batch[F.SEQ_LENS_PADDED])
    assert padded.sum(dim=1).tolist() == [48, 48, 48]

    # The same settings with a bshd contract are fine.
    bshd = instantiate(sources, contract={"attn_implementation": "fa4"})
    assert bshd.emits_thd is False
    for overrides in ({"supports_seq_lens": False}, {"cp_size": 2}):
        with recipe_build(bshd, tokenizer, **overrides) as loader:
            batch = next(iter(loader))
        assert F.SEQ_LENS not in batch and F.QKV_FORMAT not in batch


# ----------------------------------------------------------------------------- checkpointing


def test_state_saved_per_dp_rank_with_torch_save_resumes_exactly(sources, tokenizer, tmp_path):
    """``Checkpointer.save_on_dp_ranks`` writes ``torch.save(state_dict())``; ``load_on_dp_ranks`` reads it back
    with AutoModel's restricted ``load_torch_ckpt`` (``weights_only=True``) into ``load_state_dict``."""
    dataloader = instantiate(sources, read_ahead=2)
    with recipe_build(dataloader, tokenizer, packing_contract=FA4_MODEL) as loader:
        full = collect(loader)
    assert len(full) >= 8
    for k in (0, 1, 5, len(full)):
        path = tmp_path / f"step_{k}" / "dataloader" / "dataloader_dp_rank_0.pt"
        path.parent.mkdir(parents=True)
        with recipe_build(instantiate(sources, read_ahead=2), tokenizer, packing_contract=FA4_MODEL) as first:
            iterator = iter(first)
            for _ in range(k):
                next(iterator)
            torch.save(first.state_dict(), path)
        assert torch.load(path, weights_only=True) == load_torch_ckpt(str(path))
        with recipe_build(instantiate(sources, read_ahead=2), tokenizer, packing_contract=FA4_MODEL) as second:
            second.load_state_dict(load_torch_ckpt(str(path)))
            rest = collect(second)
        assert_same_batches(rest, full[k:])


def test_automodel_base_recipe_routes_the_loader_to_per_dp_rank_checkpoints(sources, tokenizer):
    from nemo_automodel.recipes.base_recipe import has_load_restore_state, is_dataloader

    with recipe_build(instantiate(sources), tokenizer) as loader:
        # AutoModel 0.7.0 saves per DP rank only what is_dataloader accepts (an isinstance check).
        assert has_load_restore_state(loader)
        assert is_dataloader(loader)


def test_validation_copy_with_packing_none_is_a_validation_loader(sources, tokenizer):
    """AutoModel's ``_should_pack_validation`` calls ``dataclasses.replace(config, packing=None)``: that copy
    builds one unshuffled ``wrap`` pass, the whole set on every DP rank (tests/test_validation_loader.py)."""
    import dataclasses
    import warnings

    config = instantiate(sources[:1])
    unpacked = dataclasses.replace(config, packing=None)
    assert unpacked.is_validation and not config.is_validation
    assert unpacked.emits_thd is False
    assert unpacked.sources == config.sources and unpacked.seed == config.seed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaders = [recipe_build(unpacked, tokenizer, dp_rank=rank, dp_world_size=2) for rank in (0, 1)]
    for loader in loaders:
        assert loader.fingerprint["packing"][0] == "wrap" and loader.fingerprint["shuffle"] is False
    with loaders[0] as first, loaders[1] as second:
        assert_same_batches(collect(first), collect(second))
        assert first.stats()["dropped"] == {}
    several = dataclasses.replace(instantiate(sources), packing=None)  # each source read once (mixture: once)
    with several.build(dp_rank=0, dp_world_size=1, tokenizer=tokenizer) as loader:
        assert loader.fingerprint["mixture"] == "once"


def test_model_contract_without_qkv_format_takes_the_yaml_thd(sources, tokenizer):
    from nemo_automodel.components.models.common.packing import PackingCapabilities

    config = instantiate(sources, contract={"packed_mask_type": "document_ids", "qkv_format": "thd"})
    with recipe_build(config, tokenizer, packing_contract=PackingCapabilities("document_ids")) as loader:
        batch = next(iter(loader))
    assert batch[F.QKV_FORMAT] == "thd" and F.SEQ_LENS_PADDED in batch
    with pytest.raises(ValueError, match="the model requires"):
        recipe_build(config, tokenizer, packing_contract=PackingCapabilities("block_causal"))
