"""The one size parser every size flag uses (common/sizes.py), against sizes written out by hand."""

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.common.sizes import parse_size

GiB = 2**30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20G", 20 * GiB),
        ("20GiB", 20 * GiB),
        ("20Gi", 20 * GiB),
        ("20gib", 20 * GiB),
        ("20GB", 20 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512M", 512 * 2**20),
        ("1.5TiB", 3 * 2**39),
        ("1.5GB", 1_500_000_000),
        (".5K", 512),
        ("7.", 7),
        ("1073741824", GiB),
        ("1073741824B", GiB),
        (" 2 GiB ", 2 * GiB),
        (4096, 4096),
    ],
)
def test_accepted_forms(text, expected):
    assert parse_size(text, "--gpu-mem") == expected


@pytest.mark.parametrize("text", ["", "GB", "5XB", "-1GB", "1e9", "nan", "inf", "2..3G", "²G", "١٢GB", "1,5G", True])
def test_refuses_what_is_not_a_size(text):
    with pytest.raises(BadInput, match=r"^--max-memory .* is not a size; accepted: a number and a unit, e\.g\. 20GiB"):
        parse_size(text, "--max-memory")


def test_a_bare_number_counts_bytes_and_a_minimum_says_what_a_unit_would_make_of_it():
    assert parse_size("20", "--max-shard-size") == 20
    bare = r"^--max-memory .20. is 20 bytes \(a bare number counts bytes\).*did you mean 20GiB\?"
    with pytest.raises(BadInput, match=bare):
        parse_size("20", "--max-memory", minimum=2**20)
    with pytest.raises(BadInput, match=r"'1KiB' is 1,024 bytes") as e:
        parse_size("1KiB", "--gpu-mem", minimum=2**20)
    assert "did you mean" not in str(e.value)  # a unit was typed: no guess


def test_zero_and_too_large():
    assert parse_size("0", "--reserve", minimum=0) == 0
    with pytest.raises(BadInput, match="must be at least 1 byte"):
        parse_size("0GB", "--kv-cache-memory")
    with pytest.raises(BadInput, match="too large"):
        parse_size("2000000TiB", "--kv-cache-memory")
    with pytest.raises(BadInput, match="too large"):
        parse_size("9" * 400, "--kv-cache-memory")
