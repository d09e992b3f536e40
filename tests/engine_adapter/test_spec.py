"""The fleet spec files load, and a spec that would mislead the gateway about a model is
refused with words that say what to fix."""

from __future__ import annotations

import pytest

from engine_adapter.conf import REPO_ROOT
from engine_adapter.sim.config import parse_args
from engine_adapter.spec import SpecError, load_spec

POOL = """
[[pools]]
name = "{name}"
model = "m"
region = "us-east"
launch = "sim"
{extra}
"""


def _spec(tmp_path, *pools: tuple[str, str]):
    path = tmp_path / "fleet.toml"
    path.write_text('[regions]\nus-east = "us"\n' + "".join(
        POOL.format(name=name, extra=extra) for name, extra in pools))
    return load_spec(path)


@pytest.mark.parametrize("name", ["dev.toml", "sim.toml"])
def test_the_shipped_specs_offer_an_embedding_model(name):
    spec = load_spec(REPO_ROOT / "engine_adapter" / "fleets" / name)
    embedding = [p for p in spec.pools if p.is_embedding]
    assert [p.model for p in embedding] == ["tollgate/tiny-embed"]
    assert not any(p.is_embedding for p in spec.pools if p.model != "tollgate/tiny-embed")


@pytest.mark.parametrize("name", ["dev.toml", "sim.toml"])
def test_every_shipped_pool_starts_as_a_simulated_engine(name):
    # ./tollgate up --sim-only launches the real-SGLang pools as simulators with the same
    # extra_args: the simulator must take every SGLang flag a shipped pool carries (it did
    # not take dev.toml's tool-call parser, and `up --sim-only` failed at start-up)
    for pool in load_spec(REPO_ROOT / "engine_adapter" / "fleets" / name).pools:
        config = parse_args(["--served-model-name", pool.model, *pool.extra_args])
        assert config.served_model_name == pool.model, pool.name


def test_a_model_served_both_ways_is_refused(tmp_path):
    with pytest.raises(SpecError, match="with and without --is-embedding"):
        _spec(tmp_path, ("a", 'extra_args = ["--is-embedding"]'), ("b", ""))


@pytest.mark.parametrize("value", ["0", "-3", '"1024"', "true"])
def test_vocab_size_must_be_a_positive_integer(tmp_path, value):
    with pytest.raises(SpecError, match="vocab_size must be a positive integer"):
        _spec(tmp_path, ("a", f"vocab_size = {value}"))


def test_vocab_size_is_read(tmp_path):
    (pool,) = _spec(tmp_path, ("a", "vocab_size = 1024")).pools
    assert pool.vocab_size == 1024 and not pool.is_embedding
