"""The packaged workload catalog and user-defined workloads."""

from __future__ import annotations

import dataclasses

import pytest

from carma.traces.catalog import PROFILE_FIELDS, Catalog, UnknownTaskError, Workload, define_workload, load_catalog


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def test_packaged_catalog_has_carmas_50_tasks(catalog):
    assert len(catalog) == 50
    assert len(set(catalog)) == 50
    assert all(name == w.name for name, w in catalog.items())


def test_a_known_row_carries_the_measured_figures(catalog):
    vgg = catalog["vgg"]
    assert vgg.solo_s == pytest.approx(50.77 * 60)
    assert vgg.mem_mib == 6684
    assert vgg.gpus == 1
    assert (vgg.model, vgg.dataset, vgg.batch_size) == ("vgg16", "imagenet", 32)
    assert dict(vgg.estimates) == {"horus": 21526, "faketensor": 3121, "gpumemnet": 16000, "xmem": 7358}


def test_missing_estimates_are_none(catalog):
    assert dict(catalog["dlrm"].estimates) == {"horus": None, "faketensor": None, "gpumemnet": None, "xmem": None}


def test_two_gpu_tasks(catalog):
    two_gpu = sorted(name for name, w in catalog.items() if w.gpus == 2)
    assert two_gpu == ["gpt2_large_2", "xlnet_base_cased_2", "xlnet_large_cased_2"]
    assert {w.gpus for w in catalog.values()} == {1, 2}


def test_every_profile_is_a_fraction_and_start_up_comes_before_the_end(catalog):
    for w in catalog.values():
        assert all(0.0 <= getattr(w, metric) <= 1.0 for metric in ("gract", "smact", "smocc", "drama")), w.name
        assert w.ttfk_s >= 0.0 and w.ttfk_s + w.warmup_s < w.solo_s, w.name
        assert 0 < w.mem_first_mib <= w.mem_mib, w.name
        assert w.smact <= w.gract + 0.05, w.name  # SMACT trails busy time


def test_unknown_name_is_a_clear_one_line_error(catalog):
    with pytest.raises(UnknownTaskError) as excinfo:
        catalog["mnist_train"]
    message = str(excinfo.value)
    assert message == "unknown task 'mnist_train': it is not in the workload catalog"
    assert "mnist_train" not in catalog


def test_typical_profile_is_the_catalogs_median(catalog):
    typical = catalog.typical_profile()
    assert set(typical) == set(PROFILE_FIELDS)
    for field, value in typical.items():
        values = sorted(getattr(w, field) for w in catalog.values())
        assert value == pytest.approx((values[24] + values[25]) / 2), field  # 50 tasks


def test_define_workload_overrides_a_catalog_task(catalog):
    vgg = define_workload("vgg", {"mem_mib": 8000, "gpus": 2}, catalog)
    assert (vgg.mem_mib, vgg.gpus) == (8000, 2)
    assert vgg == dataclasses.replace(catalog["vgg"], mem_mib=8000, gpus=2)
    assert catalog["vgg"].mem_mib == 6684  # the catalog itself is unchanged


def test_define_workload_defines_a_new_task_with_the_typical_profile(catalog):
    w = define_workload("mytask", {"solo_s": 600.0, "mem_mib": 4096}, catalog)
    assert (w.name, w.gpus, w.solo_s, w.mem_mib) == ("mytask", 1, 600.0, 4096)
    typical = catalog.typical_profile()
    assert {f: getattr(w, f) for f in PROFILE_FIELDS} == pytest.approx(typical)


def test_memory_at_first_sighting_never_exceeds_a_given_need(catalog):
    small = define_workload("vgg", {"mem_mib": 600}, catalog)
    assert small.mem_first_mib == 600 < catalog["vgg"].mem_first_mib
    tiny = define_workload("mytask", {"solo_s": 600.0, "mem_mib": 100}, catalog)
    assert tiny.mem_first_mib == 100
    with pytest.raises(ValueError, match="memory at first sighting"):
        define_workload("vgg", {"mem_mib": 600, "mem_first_mib": 700}, catalog)


def test_define_workload_keeps_given_profile_fields(catalog):
    w = define_workload("mytask", {"solo_s": 600.0, "mem_mib": 4096, "smact": 0.9, "gpus": 2}, catalog)
    assert (w.smact, w.gpus) == (0.9, 2)
    assert w.smocc == catalog.typical_profile()["smocc"]


@pytest.mark.parametrize(("fields", "missing"), [({"solo_s": 600.0}, "mem_mib"), ({"mem_mib": 4096}, "solo_s")])
def test_a_new_task_needs_solo_time_and_memory(catalog, fields, missing):
    with pytest.raises(UnknownTaskError) as excinfo:
        define_workload("mytask", fields, catalog)
    assert str(excinfo.value) == f"unknown task 'mytask': not in the workload catalog; define it with {missing}"


def test_a_name_alone_must_be_in_the_catalog(catalog):
    with pytest.raises(UnknownTaskError) as excinfo:
        define_workload("mytask", {}, catalog)
    assert str(excinfo.value) == "unknown task 'mytask': it is not in the workload catalog"


@pytest.mark.parametrize("name", ["vgg", "mytask"])
def test_define_workload_rejects_unknown_fields(catalog, name):
    with pytest.raises(ValueError, match=r"unknown field\(s\) colour, memory"):
        define_workload(name, {"solo_s": 600.0, "mem_mib": 4096, "memory": 1, "colour": "red"}, catalog)


def test_with_workloads_adds_and_replaces_without_changing_the_original(catalog):
    mine = define_workload("mytask", {"solo_s": 600.0, "mem_mib": 4096}, catalog)
    small_vgg = define_workload("vgg", {"mem_mib": 1000}, catalog)
    extended = catalog.with_workloads({"mytask": mine, "vgg": small_vgg})
    assert len(extended) == 51
    assert extended["mytask"] == mine
    assert extended["vgg"].mem_mib == 1000
    assert "mytask" not in catalog


VALID = {
    "name": "t",
    "gpus": 1,
    "solo_s": 100.0,
    "mem_mib": 1024,
    "mem_first_mib": 512,
    "gract": 0.6,
    "smact": 0.5,
    "smocc": 0.3,
    "drama": 0.3,
    "warmup_s": 5.0,
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpus": 0}, "gpus must be at least 1"),
        ({"solo_s": 0.0}, "solo time and memory must be positive and finite"),
        ({"solo_s": float("inf")}, "solo time and memory must be positive and finite"),
        ({"mem_mib": -1}, "solo time and memory must be positive and finite"),
        (
            {"ttfk_s": 95.0},
            "time to first kernel (95 s) and warm-up (5 s) must be non-negative and end before the solo time (100 s)",
        ),
        (
            {"ttfk_s": -1.0},
            "time to first kernel (-1 s) and warm-up (5 s) must be non-negative and end before the solo time (100 s)",
        ),
        ({"mem_first_mib": 2048}, "memory at first sighting must lie between 0 and the need (1024 MiB)"),
        ({"gract": 1.1}, "gract must be a fraction in [0, 1]"),
        ({"smact": 1.5}, "smact must be a fraction in [0, 1]"),
        ({"smocc": -0.1}, "smocc must be a fraction in [0, 1]"),
        ({"drama": 2.0}, "drama must be a fraction in [0, 1]"),
    ],
)
def test_workload_validation(changes, message):
    with pytest.raises(ValueError) as excinfo:
        Workload(**{**VALID, "ttfk_s": 10.0, **changes})
    assert str(excinfo.value) == message


def test_workload_validation_accepts_the_boundaries():
    w = Workload(**{**VALID, "ttfk_s": 0.0, "warmup_s": 0.0, "smact": 1.0, "smocc": 0.0, "mem_first_mib": 1024})
    assert (w.smact, w.smocc, w.ttfk_s, w.mem_first_mib) == (1.0, 0.0, 0.0, 1024)


def test_define_workload_validates_overrides(catalog):
    with pytest.raises(ValueError, match="smact must be a fraction"):
        define_workload("vgg", {"smact": 1.2}, catalog)
