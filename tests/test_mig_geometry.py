"""MIG geometry: the profiles and placements as NVIDIA's guide gives them, and the full layouts derived
from the placement rules (checked against the guide's count of A100 configurations)."""

from __future__ import annotations

import re

import pytest

from carma.core.mig.geometry import Geometry, Slot, UnknownModel
from carma.core.mig.profiles import MODELS

MODEL_NAMES = sorted(MODELS)
CLASSIC_IDS = {19, 14, 9, 5, 0}  # 1g, 2g, 3g, 4g, 7g: the profiles of the guide's A100 combination diagram


def classic(geometry: Geometry) -> Geometry:
    """The geometry with only the five profiles the guide's combination diagram draws."""
    return Geometry(geometry.model, tuple(p for p in geometry.profiles if p.profile_id in CLASSIC_IDS))


def test_a100_placements_are_the_guides():
    """`nvidia-smi mig -lgipp` on an A100, as the MIG user guide prints it."""
    g = Geometry.of("A100-40GB")
    starts = {p.profile_id: p.starts for p in g.profiles}
    assert starts == {
        19: (0, 1, 2, 3, 4, 5, 6),
        20: (0, 1, 2, 3, 4, 5, 6),
        15: (0, 2, 4, 6),
        14: (0, 2, 4),
        9: (0, 4),
        5: (0,),
        0: (0,),
    }
    sizes = {p.name: p.memory_slices for p in g.profiles}
    assert sizes == {"1g.5gb": 1, "1g.5gb+me": 1, "1g.10gb": 2, "2g.10gb": 2, "3g.20gb": 4, "4g.20gb": 4, "7g.40gb": 8}


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_model_has_the_guides_seven_profiles_and_instance_counts(model):
    g = Geometry.of(model)
    assert [(p.compute_slices, p.memory_slices, p.max_count) for p in g.profiles] == [
        (1, 1, 7),
        (1, 1, 1),
        (1, 2, 4),
        (2, 2, 3),
        (3, 4, 2),
        (4, 4, 1),
        (7, 8, 1),
    ]
    named = [p.name.split(".")[0] for p in g.profiles]
    assert named == ["1g", "1g", "1g", "2g", "3g", "4g", "7g"]
    assert [p for p in g.profiles if p.media] == [g.profiles[1]]


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_usable_memory_is_below_the_name_and_grows_with_memory_slices(model):
    """The real figures, not the names: a 3g.40gb holds about 39.5 GiB, and equal memory slices hold equal
    memory."""
    g = Geometry.of(model)
    known = [p for p in g.profiles if p.memory_mib is not None]
    for p in known:
        assert p.memory_mib < int(p.name.split(".")[1].rstrip("gb+me")) * 1024
    by_slices = {}
    for p in known:
        by_slices.setdefault(p.memory_slices, set()).add(p.memory_mib)
    assert all(len(v) == 1 for v in by_slices.values())
    ordered = [by_slices[k].pop() for k in sorted(by_slices)]
    assert ordered == sorted(ordered)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_the_guides_19_a100_configurations_are_derived_not_listed(model):
    """NVIDIA's combination diagram: 19 full layouts of 1g/2g/3g/4g/7g; 18 before driver R510, which did not
    allow a 4g beside a 3g (the guide's note)."""
    layouts = classic(Geometry.of(model)).layouts
    assert len(layouts) == 19
    four_beside_three = {Slot(0, 4, 4), Slot(4, 4, 3)}
    assert len([layout for layout in layouts if not four_beside_three <= layout]) == 18


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_layout_is_legal_and_full(model):
    g = Geometry.of(model)
    assert len(g.layouts) == 78  # with the 1g on two memory slices (profile 15) among the shapes
    for layout in g.layouts:
        memory = 0
        for s in layout:
            assert not s.mask & memory, f"{sorted(layout)} overlaps"
            memory |= s.mask
        assert sum(s.compute_slices for s in layout) <= g.compute_slices
        free = [s for s in g.slots if s not in layout and not s.mask & memory]
        assert all(sum(t.compute_slices for t in layout) + s.compute_slices > 7 for s in free), "not full"
    assert len(set(g.layouts)) == len(g.layouts)


def test_profile_15_adds_layouts_and_keeps_the_classic_ones_full():
    g = Geometry.of("A100-40GB")
    assert set(classic(g).layouts) <= set(g.layouts)


def test_design_notes_placement_facts():
    """MIG.md: `4g + 4g` is impossible, `3g + 3g` leaves no room for a 1g though a compute slice is free,
    `4g + 3g` is valid."""
    g = Geometry.of("A100-40GB")
    four, three, one = g.profile("4g.20gb"), g.profile("3g.20gb"), g.profile("1g.5gb")
    assert four.starts == (0,)
    threes = [g.slot(three, 0), g.slot(three, 4)]
    two_threes = g.bits(threes)
    assert g.is_full(two_threes) and sum(s.compute_slices for s in threes) == 6  # a compute slice left over
    assert all(g.reachable(two_threes | g.bits([g.slot(one, s)])) == 0 for s in one.starts)
    assert g.is_full(g.bits([g.slot(four, 0), g.slot(three, 4)]))
    assert g.reachable(g.bits([g.slot(four, 0), g.slot(three, 0)])) == 0


def test_migm_example_the_last_slice_keeps_the_most_layouts_reachable():
    """MIGM section 4.2: on an empty A100-40GB a 5 GB instance on the last slice keeps the most full layouts
    reachable (the paper counts 9 against 7 on the other slices; over the guide's 19 layouts the counts are
    12 against 6)."""
    g = classic(Geometry.of("A100-40GB"))
    one = g.profile("1g.5gb")
    reach = {s: g.reachable(g.bits([g.slot(one, s)])) for s in one.starts}
    assert reach == {0: 6, 1: 6, 2: 6, 3: 6, 4: 6, 5: 6, 6: 12}
    assert g.reachable(0) == 19


def test_sizing_is_tightest_first_and_leaves_out_media_and_unknown_memory():
    g = Geometry.of("A100-40GB")
    assert [p.name for p in g.sizing] == ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    assert [p.name for p in g.holding(5000)][:2] == ["1g.10gb", "2g.10gb"]
    assert g.holding(40193) == ()
    h200 = Geometry.of("H200-141GB")
    assert "3g.71gb" not in [p.name for p in h200.sizing]  # no source gave its memory: never sized on


def test_next_larger_profile_for_an_out_of_memory_restart():
    g = Geometry.of("A100-40GB")
    chain, p = [], g.profile("1g.5gb")
    while p is not None:
        chain.append(p.name)
        p = g.next_larger(p)
    assert chain == ["1g.5gb", "1g.10gb", "3g.20gb", "7g.40gb"]


def test_a_cards_reported_memory_replaces_the_table():
    g = Geometry.of("H200-141GB").with_reported({"3g.71gb": 71_000, "4g.71gb": 71_000})
    assert g.profile("3g.71gb").memory_mib == 71_000
    assert [p.name for p in g.holding(60_000)] == ["3g.71gb", "4g.71gb", "7g.141gb"]
    assert Geometry.of("H200-141GB").profile("3g.71gb").memory_mib is None  # the table is not changed


def test_an_unknown_model_or_profile_is_one_clear_line():
    with pytest.raises(UnknownModel, match=re.escape("no MIG geometry for GPU model 'V100'; known: A100-40GB")):
        Geometry.of("V100")
    with pytest.raises(ValueError, match=re.escape("A100-40GB has no MIG profile '5g.30gb'")):
        Geometry.of("A100-40GB").profile("5g.30gb")


@pytest.mark.parametrize(
    ("product", "total_mib", "model"),
    [
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", 40536, "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", 81920, "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
    ],
)
def test_a_card_is_matched_to_its_geometry_by_name_and_memory(product, total_mib, model):
    assert Geometry.for_product(product, total_mib).model == model


def test_a_card_of_another_size_is_not_taken_for_a_known_one():
    """An H100 NVL (94 GB) has other profiles than an H100-80GB: refused, not guessed."""
    with pytest.raises(UnknownModel, match=re.escape("no MIG geometry for 'NVIDIA H100 NVL' with 95830 MiB")):
        Geometry.for_product("NVIDIA H100 NVL", 95830)
