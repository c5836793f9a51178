"""Cached generation through ``transformers``: ``MsarForCausalLM.generate`` with the ``DecodeCache``.

Reference: the same folder generating with ``use_cache=False`` (every step a full forward over the
prefix, the training model's own math). Exported in fp64 so that greedy / sampled / beam choices cannot
flip on rounding: the sequences must be identical. Left padding: a batch equals each prompt alone.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from msar_train.export import hf
from msar_train.model.cache import DecodeCache
from tests.unit.export_helpers import make_run

PROMPTS = ["To be, or not to be", "All the world's a stage, and all the men", "The slings"]


@pytest.fixture(scope="module", params=["msar", "mhc", "attnres", "msar_b2"])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    run, _ = make_run(root, request.param)
    out = hf.export(run, root / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    return m, tok


def _gen(m, inputs, **kw):
    with torch.no_grad():
        return m.generate(**inputs, max_new_tokens=10, eos_token_id=None, pad_token_id=m.config.pad_token_id, **kw)


def _one(tok, text):
    return tok(text, return_tensors="pt", add_special_tokens=False)


def test_greedy_cached_equals_uncached(exported):
    m, tok = exported
    inputs = _one(tok, PROMPTS[0])
    assert m.generation_config.use_cache  # the exported default
    assert torch.equal(_gen(m, inputs, do_sample=False), _gen(m, inputs, do_sample=False, use_cache=False))


def test_sampled_and_beam_cached_equal_uncached(exported):
    m, tok = exported
    inputs = _one(tok, PROMPTS[1])
    kw = dict(do_sample=True, temperature=0.9, top_k=30, top_p=0.95)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        runs.append(_gen(m, inputs, use_cache=use_cache, **kw))
    assert torch.equal(*runs)
    beams = [_gen(m, inputs, num_beams=3, do_sample=False, use_cache=c) for c in (True, False)]
    assert torch.equal(*beams)  # beam search reorders the cache (DecodeCache.reorder_cache)


def test_left_padded_batch_equals_each_prompt_alone(exported):
    m, tok = exported
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    assert not bool(batch["attention_mask"].all())  # really padded
    got = _gen(m, batch, do_sample=False)
    for i, text in enumerate(PROMPTS):
        alone = _gen(m, _one(tok, text), do_sample=False)
        assert got[i, -alone.shape[1] :].tolist() == alone[0].tolist(), text
    # and the padded batch without a cache agrees too (padding handled by the full forward as well)
    assert torch.equal(got, _gen(m, batch, do_sample=False, use_cache=False))


def test_forward_returns_and_extends_the_cache(exported):
    m, tok = exported
    ids = _one(tok, PROMPTS[0])["input_ids"]
    with torch.no_grad():
        full = m(ids).logits
        assert m(ids).cache is None  # a plain call is the training forward
        out = m(ids[:, :4], use_cache=True)
        assert isinstance(out.cache, DecodeCache) and out.cache.get_seq_length() == 4
        step = m(ids[:, 4:], attention_mask=torch.ones_like(ids), cache=out.cache)
    assert step.cache.get_seq_length() == ids.shape[1]
    got = torch.cat([out.logits, step.logits], 1)
    assert ((got - full).abs().max() / full.abs().max()).item() < 1e-10
    with pytest.raises(ValueError, match="attention_mask has shape"):
        m(ids[:, :1], attention_mask=torch.ones(1, 3, dtype=torch.long), cache=step.cache)
