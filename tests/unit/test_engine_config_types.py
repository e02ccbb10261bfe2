"""EngineConfig checks each scalar field's type itself, so every way in (CLI, YAML, Python,
a config sent over Ray) gets the same answer: a wrong type is an error naming the field."""
import pytest

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.errors import HyraxInputError


@pytest.mark.parametrize("field,value", [
    ("deterministic", "false"),  # a truthy string would switch the mode ON
    ("overlap", 1),
    ("prefix_cache", None),
    ("max_running", 3.7),  # would reach the scheduler as a float
    ("page_size", True),  # a bool is no count
    ("kv_capacity_tokens", "8192"),
    ("swa_capacity_tokens", 1.5),
    ("host_pool_mb", "256"),
    ("gpu_memory_fraction", False),
    ("dtype", 32),
])
def test_wrong_type_is_an_error_naming_the_field(field, value):
    with pytest.raises(HyraxInputError, match=field.replace("_", "-")):
        EngineConfig(**{field: value})


def test_right_types_pass_and_an_int_is_a_float():
    c = EngineConfig(host_pool_mb=64, gpu_memory_fraction=1, swa_capacity_tokens=None, max_model_len=512,
                     deterministic=True, overlap=False)
    assert c.host_pool_mb == 64 and c.max_model_len == 512
