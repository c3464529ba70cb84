"""Quantities in messages: memory sizes as users write them in traces and workload definitions, counts,
spans of time."""

from __future__ import annotations

import pytest

from carma.units import in_unit, inflect, parse_mib, parse_seconds, pluralize, time_unit

KIB, GIB, TIB = 2**10, 2**30, 2**40


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("6000", 6000),
        (6000, 6000),
        (512.0, 512),
        ("512MiB", 512),
        ("512M", 512),
        ("8GiB", 8 * 1024),
        ("8G", 8 * 1024),
        ("1TiB", 1024 * 1024),
        ("1T", 1024 * 1024),
        ("2048KiB", 2),
        ("2048K", 2),
        ("1048576B", 1),
    ],
)
def test_bare_numbers_are_mib_and_binary_units_are_powers_of_1024(text, mib):
    assert parse_mib(text) == mib


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [("20GB", 20 * 10**9), ("500MB", 500 * 10**6), ("3000KB", 3000 * 10**3), ("1TB", 10**12)],
)
def test_kb_mb_gb_tb_are_decimal_as_on_datasheets(text, n_bytes):
    assert parse_mib(text) == -(-n_bytes // 2**20)


def test_decimal_and_binary_gigabytes_differ():
    assert parse_mib("40GB") == 38147  # 40e9 bytes
    assert parse_mib("40GiB") == 40960


@pytest.mark.parametrize(
    ("text", "mib"),
    [("0.5", 1), ("1.1GiB", 1127), ("1.5KiB", 1), (f"{GIB + 1}B", 1025), ("1000001B", 1), ("0.25MiB", 1)],
)
def test_rounds_up_to_a_whole_mib(text, mib):
    assert parse_mib(text) == mib


@pytest.mark.parametrize("text", ["8gib", "8GIB", "8gIb", "8 GiB", "  8GiB  ", "8g"])
def test_units_are_case_insensitive_and_spaces_are_allowed(text):
    assert parse_mib(text) == 8192


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "cannot read 'lots' as a memory size"),
        ("", "cannot read '' as a memory size"),
        ("8 GiB extra", "cannot read"),
        ("1e3", "cannot read"),
        ("-5GiB", "cannot read"),
        ("GiB", "cannot read"),
        ("8PiB", "unknown memory unit 'pib'"),
        ("8bytes", "unknown memory unit 'bytes'"),
        ("0", "must be positive"),
        ("0GiB", "must be positive"),
        (0, "must be positive"),
        (-4096, "must be positive"),
        (-0.5, "must be positive"),
    ],
)
def test_garbage_zero_and_negative_sizes_are_a_clear_value_error(text, message):
    with pytest.raises(ValueError, match=r"^[^\n]+$") as excinfo:
        parse_mib(text)
    assert message in str(excinfo.value)


def test_a_positive_size_never_becomes_zero_mib():
    assert parse_mib("0.5B") == 1


def test_an_infinite_size_is_a_value_error():
    with pytest.raises(ValueError):
        parse_mib(float("inf"))


@pytest.mark.parametrize(("n", "text"), [(0, "0 tasks"), (1, "1 task"), (2, "2 tasks")])
def test_a_count_takes_the_noun_in_its_number(n, text):
    assert pluralize(n, "task") == text


@pytest.mark.parametrize(("n", "verb"), [(0, "have"), (1, "has"), (2, "have")])
def test_a_verb_agrees_with_its_count(n, verb):
    assert inflect(n, "has", "have") == verb


def test_a_noun_with_an_irregular_plural_names_it():
    assert (pluralize(1, "relaunch", "relaunches"), pluralize(3, "relaunch", "relaunches")) == (
        "1 relaunch",
        "3 relaunches",
    )


@pytest.mark.parametrize(
    ("seconds", "text"), [(30.0, "0.5 min"), (2100.0, "35.0 min"), (7199.0, "120.0 min"), (37440.0, "10.40 h")]
)
def test_spans_under_two_hours_are_in_minutes_longer_ones_in_hours(seconds, text):
    unit = time_unit(seconds)
    assert f"{in_unit(seconds, unit)} {unit[1]}" == text


def test_a_size_past_a_pebibyte_is_refused_not_said_in_float_noise():
    assert parse_mib("1024TiB") == 2**30
    with pytest.raises(ValueError, match=r"^memory size '1025TiB' is over 1 PiB, more than any GPU holds$"):
        parse_mib("1025TiB")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0.0 MiB"), (512, "0.5 KiB"), (40 * 2**10, "40.0 KiB"), (2**20, "1.0 MiB"), (3 * 2**29, "1.50 GiB")],
)
def test_sizes_for_people_keep_a_small_model_s_kibibytes(n, text):
    """A model of a few KiB read "0.0 MiB" in each part of its estimate."""
    from carma.units import size_text

    assert size_text(n) == text


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2h", 7200), ("90min", 5400), ("90m", 5400), ("1h30m", 5400), ("1.5h", 5400), ("45s", 45), ("1d", 86400),
     (" 2 h ", 7200), ("90MIN", 5400), (3600, 3600), (12.5, 12.5)],
)  # fmt: skip
def test_a_run_time_is_read_with_its_units_and_a_number_is_seconds(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("text", ["2", "2x", "", "h", "2h later", "0s", -5, "400d"])
def test_a_run_time_without_a_unit_or_out_of_range_is_refused_in_one_line(text):
    with pytest.raises(ValueError, match=r"run time") as e:
        parse_seconds(text)
    assert "\n" not in str(e.value)
