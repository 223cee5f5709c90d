"""The exact de-duplication filter's keys on disk (`posttrain.data.seen_keys.SeenKeys`)."""

from __future__ import annotations

from posttrain.data.seen_keys import SeenKeys


def test_keys_are_seen_at_once_kept_per_part_and_forgotten_from_a_part_on(tmp_path):
    path = tmp_path / "seen.sqlite"
    seen = SeenKeys(path)
    seen.part = 0
    seen[b"a" * 16] = ("s", 1)
    assert seen.get(b"a" * 16) == ("s", 1) and len(seen) == 1 and not seen.holds(0)
    seen.commit()
    assert seen.holds(0) and seen.get(b"a" * 16) == ("s", 1)
    seen.part = 1
    seen[b"b" * 16] = ("t", 2)
    seen.save_part(tmp_path / "part-1.keys.npz")  # what another machine takes up
    seen.commit()
    seen.part = 2
    seen[b"c" * 16] = ("t", 4)
    seen.forget_from(2)  # uncommitted keys of a part forgotten go too
    seen.part = 3
    seen[b"d" * 16] = ("t", 5)
    seen.close()  # what was set since the last commit is kept

    again = SeenKeys(path)
    assert len(again) == 3 and again.get(b"c" * 16) is None and again.holds(1) and not again.holds(2)
    again.forget_from(1)  # parts 1 and later
    assert again.get(b"a" * 16) == ("s", 1) and again.get(b"b" * 16) is None and not again.holds(1)
    again.close()

    elsewhere = SeenKeys(tmp_path / "other.sqlite")  # a machine without the table: part 1 from its file
    elsewhere[b"b" * 16] = ("u", 9)  # known already: keeps its first origin
    elsewhere.load_part(tmp_path / "part-1.keys.npz", 1)
    assert elsewhere.holds(1) and elsewhere.get(b"b" * 16) == ("u", 9) and len(elsewhere) == 1
    elsewhere.close()
