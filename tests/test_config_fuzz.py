"""Fuzzing the config loader: random keys, types and nesting give a Config or one ConfigError, never a crash."""

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.config import Config, ConfigError, load_config
from megatron.config.schema import SCHEMA
from tests.test_config import MINIMAL

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
known_keys = st.sampled_from(sorted(SCHEMA))
any_keys = st.one_of(known_keys, st.text(max_size=20), known_keys.map(lambda k: k.replace("_", "-")))


def loads_or_refuses(values_dict, world_size=None) -> None:
    try:
        cfg = Config.from_dict(values_dict, world_size=world_size)
    except ConfigError as error:
        assert str(error).strip(), "a ConfigError must say what is wrong"
        return
    # Whatever was accepted round-trips and keeps the declared types.
    assert Config.from_json(cfg.to_json()) == cfg


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(any_keys, values, max_size=6), st.sampled_from([None, 1, 2, 3, 8]))
def test_random_overrides_of_a_valid_config(changes, world_size):
    loads_or_refuses({**MINIMAL, **changes}, world_size)


@settings(max_examples=100, deadline=None)
@given(values)
def test_any_yaml_document(document):
    try:
        Config.from_dict(document)
    except ConfigError as error:
        assert str(error).strip()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_arbitrary_file_text(tmp_path, text):
    path = tmp_path / "fuzz.yml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config([path])
    except ConfigError as error:
        assert str(error).strip()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(known_keys, st.text(max_size=30))
def test_arbitrary_override_strings(tmp_path, key, text):
    path = tmp_path / "base.yml"
    path.write_text(yaml.safe_dump(MINIMAL), encoding="utf-8")
    try:
        load_config([path], [f"{key}={text}"])
    except ConfigError as error:
        assert str(error).strip()
