import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuner.errors import UserError
from tuner.space import Shape, parse_shape


def test_parse_and_arithmetic():
    s = parse_shape("4096x4096x8192")
    assert s == Shape(4096, 4096, 8192)
    assert s.flops == 2 * 4096 * 4096 * 8192
    assert s.min_bytes == 2 * (4096 * 8192 * 2 + 4096 * 4096)
    assert str(s) == "4096x4096x8192"
    assert s.tflops(1e6) == pytest.approx(s.flops / 1e12)


@pytest.mark.parametrize("bad", ["4096x4096", "0x1x1", "axbxc", "", "1x1x1x1", "-1x2x3", "4096 4096 8192"])
def test_bad_shapes_name_the_input(bad):
    with pytest.raises(UserError) as err:
        parse_shape(bad)
    assert repr(bad) in str(err.value)


@given(st.integers(1, 1 << 20), st.integers(1, 1 << 20), st.integers(1, 1 << 20))
def test_roundtrip(m, n, k):
    assert parse_shape(str(Shape(m, n, k))) == Shape(m, n, k)


@given(st.text(max_size=30))
def test_garbage_never_crashes(text):
    try:
        s = parse_shape(text)
    except UserError:
        return
    assert min(s.M, s.N, s.K) >= 1
