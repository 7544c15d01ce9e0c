"""Stage splits, anchor presets, depth -> type, and the staircase view (docs/DESIGN.md, "Terms")."""

import pytest

from spd_lightning.geometry import Geometry, GeometryError, anchor_preset, uniform_split


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_uniform_split_l32(n):
    e = uniform_split(32, n)
    assert e[0] == 0 and e[-1] == 32 and len(e) == n + 1
    assert all(b - a == 32 // n for a, b in zip(e, e[1:]))


def test_uniform_split_uneven_is_balanced():
    e = uniform_split(30, 4)
    assert e == [0, 8, 15, 22, 30]  # round(s * 7.5): stage sizes differ by at most one
    assert max(b - a for a, b in zip(e, e[1:])) - min(b - a for a, b in zip(e, e[1:])) <= 1


@pytest.mark.parametrize(
    "n, expected",
    [
        (2, [0, 16, 31, 32]),  # 3L/n and 6L/n clip to L
        (4, [0, 8, 24, 31, 32]),
        (8, [0, 4, 12, 24, 31]),
        (16, [0, 2, 6, 12, 31]),
    ],
)
def test_n_scaled_preset_l32(n, expected):
    assert anchor_preset("n_scaled", 32, n) == expected


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_quarters_preset_l32(n):
    assert anchor_preset("quarters", 32, n) == [0, 8, 16, 24, 31]


def test_types_follow_eligible_anchors():
    g = Geometry.build(32, 8, anchors="quarters")  # e = 0,4,8,...,32
    assert g.split == (0, 4, 8, 12, 16, 20, 24, 28, 32)
    assert [g.type_of(k) for k in range(9)] == [1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert g.eligible(3) == (0, 8)
    assert g.num_types == 5
    assert [g.representative_depth(t) for t in range(1, 6)] == [0, 2, 4, 6, 8]
    assert g.anchors_of_stage(1) == (0,) and g.anchors_of_stage(2) == (8,) and g.anchors_of_stage(8) == (31,)


def test_view_is_the_staircase():
    g = Geometry.build(8, 4, anchors=[0, 2, 4, 8])
    assert g.view(5, 3) == [(4, 0), (4, 1), (4, 2), (2, 3), (1, 4), (0, 5)]
    assert g.view(1, 4) == [(1, 0), (0, 1)]  # fewer positions than the fill level
    post = Geometry.build(8, 4, anchors=[0, 2, 4, 8], schedule="post_step")
    assert post.view(5, 4) == [(4, 0), (4, 1), (4, 2), (3, 3), (2, 4), (1, 5)]


def test_first_stage_features_see_only_stage_one():
    g = Geometry.build(8, 4, features="first_stage", schedule="post_step")
    assert g.anchors == (0, 2)
    assert [g.type_of(k) for k in range(5)] == [1, 2, 2, 2, 2]


@pytest.mark.parametrize("anchors", [[0, 2, 4, 6, 8], "quarters"])
def test_anchors_that_first_stage_features_would_drop_are_one_line(anchors):
    """PPSD's drafter reads the embedding and stage 1's output: explicit anchors were replaced by [0, e_1] silently."""
    with pytest.raises(GeometryError, match="with features='first_stage'"):
        Geometry.build(8, 4, anchors=anchors, features="first_stage", schedule="post_step")
    g = Geometry.build(8, 4, features="first_stage", schedule="post_step")
    assert Geometry.build(8, 4, anchors=list(g.anchors), features="first_stage").anchors == g.anchors  # with_mode's
    assert g.with_mode("ppsd") == g


def test_round_trip_dict():
    g = Geometry.build(12, 3, split=[0, 3, 8, 12], anchors="quarters", schedule="post_step")
    assert Geometry.from_dict(g.to_dict()) == g


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(num_layers=4, n=5), "n=5 stages but the target has only L=4"),
        (dict(num_layers=8, n=0), "n=0"),
        (dict(num_layers=8, n=2, split=[0, 4, 4, 8]), "has 4 entries"),
        (dict(num_layers=8, n=3, split=[0, 4, 4, 8]), "stage 2 has no layer"),
        (dict(num_layers=8, n=2, split=[0, 4, 9]), "must start at 0 and end at L=8"),
        (dict(num_layers=8, n=2, anchors=[0, 4, 2]), "strictly increasing"),
        (dict(num_layers=8, n=2, anchors=[0, 4, 9]), "out of range"),
        (dict(num_layers=8, n=2, anchors=[2, 4]), "must start with 0"),
        (dict(num_layers=8, n=2, anchors="thirds"), "unknown anchor preset 'thirds'"),
    ],
)
def test_impossible_settings_fail_with_one_line(kwargs, needle):
    with pytest.raises(GeometryError) as e:
        Geometry.build(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)
